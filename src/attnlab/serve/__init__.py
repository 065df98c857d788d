"""`attnlab serve`: an HTTP inference server for every kind of model folder.

models.py picks the folder's kind and runs the library's functions on a batch; batching.py
gathers concurrent requests into batches run in one worker thread; app.py holds the FastAPI
endpoints; limits.py the API key, request bounds and error shape; metrics.py Prometheus;
server.py runs it all under uvicorn.
"""

from .app import BatchSettings, create_app
from .limits import Limits
from .models import load_served
from .server import serve

__all__ = ["BatchSettings", "Limits", "create_app", "load_served", "serve"]
