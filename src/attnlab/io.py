"""Safe file input and output: text read line by line with errors that name the line, atomic
writes, and output directories never silently overwritten, nor written by two runs at once."""

from __future__ import annotations

import glob
import gzip
import math
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from attnlab.errors import AttnlabError, first_line

try:
    import fcntl
except ImportError:  # Windows: training runs go unlocked (lock_out_dir)
    fcntl = None


def json_safe(value: object) -> object:
    """value with every NaN or infinite float (inside dicts and lists too) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _temp_name(path: Path) -> Path:
    # A fresh sibling name, created by the caller with open(..., "x") or mkdir: unlike
    # mkstemp/mkdtemp (0600/0700) these honour the umask, so results stay readable by others.
    return path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write bytes to path via a temp file in the same directory and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(path)
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _mode_for(path))
        os.replace(tmp, path)
    except BaseException as err:
        _discard(tmp)
        raise_for_target(err, tmp, path)
        raise


def _discard(tmp: Path) -> None:
    """Delete a temp file of a failed write, if it is there."""
    # A read-only file system refuses even the unlink of a file that was never made: that
    # error must not replace the one being raised (and name the temp file, not the target).
    with suppress(OSError):
        tmp.unlink(missing_ok=True)


def raise_for_target(err: BaseException, temp: Path, target: Path) -> None:
    """Raise an error about temp (or its contents) again as one about target, else return.

    A full disk or a refused write surfaces while the temp file or directory is written; the
    user named target, and temp is gone once the error is reported.
    """
    if isinstance(err, OSError) and err.errno is not None:
        where = str(err.filename) if err.filename is not None else str(temp)
        if where == str(temp) or where.startswith(str(temp) + os.sep):
            where = str(target) + where[len(str(temp)) :]
            raise type(err)(err.errno, err.strerror, where) from err
    elif isinstance(err, AttnlabError) and str(temp) in str(err):
        raise AttnlabError(str(err).replace(str(temp), str(target))) from err


def write_text_atomic(path: Path, text: str) -> None:
    """Write UTF-8 text to path atomically."""
    write_bytes_atomic(path, text.encode("utf-8"))


def check_input_file(path: Path, what: str = "file") -> Path:
    """path, if it names an existing file; else an AttnlabError that says what is wrong."""
    path = Path(path)
    if path.is_dir():
        raise AttnlabError(f"{what} {path} is a directory, not a file")
    if path.exists() and not path.is_file():  # read twice by some readers: a file it must be
        raise AttnlabError(
            f"{what} {path} is not a regular file (a pipe or device): give a file, or - for stdin "
            "where the command reads it"
        )
    if not path.is_file():
        raise AttnlabError(f"{what} {path} not found")
    return path


def text_lines(path: Path, what: str = "") -> Iterator[str]:
    """Yield the lines of a UTF-8 text file (.gz too), endings kept, without a byte-order mark.

    Lines are decoded one by one so that an error names the line; ``what`` ("corpus file ")
    goes before the path in an error about reading the file. A byte-order mark, which Windows
    editors put at the start of a file, is not text: left in, it would stick to the first word.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as stream:
            for number, raw in enumerate(stream, start=1):
                yield decode_line(raw, path, number)
    except (OSError, EOFError) as error:  # gzip.BadGzipFile is an OSError
        raise AttnlabError(f"cannot read {what}{path}: {error}") from error


def text_pieces(path: Path, what: str = "", size: int = 1 << 20) -> Iterator[tuple[str, bool]]:
    """Yield a UTF-8 text file's lines (.gz too) in pieces of at most `size` bytes: (text, ends_line).

    As text_lines, but a line of any length costs at most `size` bytes at a time (a corpus
    that is one 50 MB line): a piece ends at a line's end or before a character cut by the
    size. The line ending stays on its line's last piece.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as stream:
            number, column, carried = 1, 0, b""
            while raw := stream.readline(size):
                ends = raw.endswith(b"\n")
                if ends and not column and not carried:  # a whole line: no cut to look for
                    yield decode_line(raw, path, number), True
                    number += 1
                    continue
                data = carried + raw
                cut = len(data) if ends else len(data) - _cut_character(data)
                data, carried = data[:cut], data[cut:]
                yield decode_line(data, path, number, column), ends
                column += len(data)
                if ends:
                    number, column = number + 1, 0
            if carried:  # the file ends inside a character
                decode_line(carried, path, number, column)
            if column:  # a last line without a line ending ends with the file
                yield "", True
    except (OSError, EOFError) as error:  # gzip.BadGzipFile is an OSError
        raise AttnlabError(f"cannot read {what}{path}: {error}") from error


def _cut_character(data: bytes) -> int:
    """How many bytes at the end of data begin a UTF-8 character that they do not complete."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: the character's first
            length = 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
            return back if byte >= 0xC0 and back < length else 0
    return 0


def decode_line(raw: bytes, source: str | Path, number: int, column: int = 0) -> str:
    """Line `number` (from 1) of source as text; not UTF-8 is an error naming the line and byte.

    ``column``: where raw starts in its line, in bytes, when raw is a piece of a line.
    """
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise AttnlabError(
            f"{source}, line {number}: not valid UTF-8 "
            f"(byte {raw[error.start]:#04x} at column {column + error.start + 1})"
        ) from error
    return line.removeprefix("\ufeff") if number == 1 and column == 0 else line


def check_no_lone_surrogates(value: object, where: str) -> None:
    """Refuse a string (a key too) inside parsed JSON that holds half of a UTF-16 pair.

    JSON's escape \\ud800 without the low half after it decodes to a lone surrogate, which is
    no character: the tokenizer fails on it with a bare TypeError, a UTF-8 writer cannot write it.
    """
    pending = [value]
    while pending:  # a stack: nesting that json.loads took could overflow a recursion here
        item = pending.pop()
        if isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as error:
                shown = item if len(item) <= 40 else item[:37] + "..."
                raise AttnlabError(
                    f"{where}: the text {shown!r} holds the escape "
                    f"\\u{ord(item[error.start]):04x}, half of a UTF-16 surrogate pair without "
                    "its other half: not a character"
                ) from None


def _default_mode() -> int:
    """A new file's permissions under this process's umask (0o644 under the usual 022)."""
    umask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(umask)
    return 0o666 & ~umask


def _mode_for(path: Path) -> int:
    """Permissions for a file written to path: the replaced file's (a private one stays so),
    else the umask's."""
    return stat.S_IMODE(path.stat().st_mode) if path.exists() else _default_mode()


def write_with_atomic(path: Path, writer: Callable[[Path], None]) -> None:
    """Call writer(tmp_path) and rename the result onto path (for libraries that write files)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(path)
    try:
        writer(tmp)
        os.chmod(tmp, _mode_for(path))  # safetensors >= 0.8 creates its files 0600
        os.replace(tmp, path)
    except BaseException as err:
        _discard(tmp)
        raise_for_target(err, tmp, path)
        raise_library_write_error(path, err)
        raise


def raise_library_write_error(path: Path, err: BaseException) -> None:
    """Raise a one-line AttnlabError for a library's own error while writing path, else return.

    safetensors and torch.save report a full disk as SafetensorError or RuntimeError, not as
    OSError (which the command line already turns into one line).
    """
    if isinstance(err, Exception) and not isinstance(err, (OSError, AttnlabError)):
        raise AttnlabError(f"cannot write {path}: {first_line(err)}") from err


def _check_makeable(path: Path, flag: str) -> None:
    """Refuse a path below a file (the folders it needs could never be made)."""
    above = next((p for p in path.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise AttnlabError(
            f"{flag} {path} cannot be made: {above} is a file, not a directory", options=(flag,)
        )


def resolved_path(path: Path, flag: str) -> Path:
    """path with every symbolic link followed, or a one-line error (a loop of links)."""
    try:
        return path.resolve()
    except (RuntimeError, OSError) as err:  # RuntimeError: "Symlink loop from ..."
        raise AttnlabError(f"{flag} {path} cannot be used: {err}", options=(flag,)) from None


def check_out_location(out: Path, inputs: Sequence[str | Path] = (), flag: str = "out") -> None:
    """Refuse an output directory that cannot be made, or whose replacement would lose an input.

    Replacing out replaces everything below it: an out that is, or holds, one of the
    command's inputs is refused, as is one that names no directory of its own ('.', '..', '/').
    flag names out in messages (an AttnlabError option: the CLI says its flag).
    """
    out = Path(out)
    where = resolved_path(out, flag)
    options = (flag,)
    if out.name in ("", ".", ".."):
        raise AttnlabError(
            f"{flag} {str(out)!r} names no directory of its own: give a new one", options=options
        )
    for source in map(Path, inputs):
        if not source.exists():
            continue
        if where == source.resolve():
            raise AttnlabError(
                f"{flag} {out} is the input {source}: write to another directory", options=options
            )
        if where in source.resolve().parents:
            raise AttnlabError(
                f"{flag} {out} holds the input {source}: choose another {flag}", options=options
            )
    _check_makeable(out, flag)


def check_output_file(
    output: str | Path, overwrite: bool = False, inputs: Sequence[str | Path] = ()
) -> Path:
    """Where to write output: no directory, input or file within one; existing if overwrite.

    A symbolic link is written through (the file it names is replaced, the link stays); an
    existing output that is not a regular file (a FIFO, a device) is refused, since the
    atomic write would replace it with a file.
    """
    options = ("output", "overwrite")  # the CLI says --output and --overwrite
    if str(output).endswith(os.sep):  # Path() would drop the slash and write a file there
        raise AttnlabError(f"output {output} names a directory: name a file", options=options)
    output = Path(output)
    resolved = resolved_path(output, "output")
    if output.is_symlink():
        output = resolved
    if output.is_dir():
        raise AttnlabError(f"output {output} is a directory: name a file", options=options)
    if output.exists() and not output.is_file():
        raise AttnlabError(
            f"output {output} is not a regular file (a device or FIFO?): name a file",
            options=options,
        )
    for source in map(Path, inputs):
        if source.exists() and source.resolve() in (resolved, *resolved.parents):
            raise AttnlabError(f"output {output} would replace the input {source}", options=options)
    _check_makeable(output, "output")
    if output.exists() and not overwrite:
        raise AttnlabError(
            f"output {output} exists (pass overwrite to replace it)", options=options
        )
    return output


def check_out_dir(
    out: Path, overwrite: bool = False, inputs: Sequence[str | Path] = (), flag: str = "--out"
) -> None:
    """Refuse an output directory that already holds files, unless overwrite is set.

    ``check_out_location`` first: with or without overwrite, out must be a place of its own.
    flag names out in messages ("--out" on the command line, "out" for a Python argument).
    """
    out = Path(out)
    check_out_location(out, inputs, flag)
    if out.exists() and not out.is_dir():
        raise AttnlabError(f"{flag} {out} exists and is not a directory")
    if contents(out) and not overwrite:  # temp files of a killed write are not contents
        how = "--overwrite" if flag.startswith("--") else "overwrite=True"
        raise AttnlabError(f"{flag} {out} already holds files (pass {how} to replace them)")


def clear_dir(out: Path) -> None:
    """Make out an empty directory in one step: the old one is renamed aside, then deleted.

    A run started with --overwrite clears its --out this way before it writes anything, so a
    kill at any moment leaves either the old run whole or no part of it (never old checkpoints
    beside the new run's vocabulary, for --resume to continue by mistake).
    """
    out = Path(out)
    if out.is_symlink():  # the folder it names is cleared, the link stays (as in staged_dir)
        out = resolved_path(out, "--out")
    remove_trash_of(out)  # what a kill during an earlier clear left beside out
    if out.exists():
        trash = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".old"))
        os.replace(out, trash / "old")
        out.mkdir()
        shutil.rmtree(trash, ignore_errors=True)
    else:
        out.mkdir(parents=True)


# What _temp_name and the trash of clear_dir / staged_dir are called: .NAME.<32 hex>.tmp and
# .NAME.<8 characters of mkdtemp>.old
_LEFTOVER = re.compile(r"^\..+\.(?:[0-9a-f]{32}\.tmp|[a-z0-9_]{8}\.old)$")
# The lock of an output directory NAME (lock_out_dir): .NAME.lock beside it, where the renames
# of --overwrite (clear_dir), which put a new folder in NAME's place, leave it be.
_LOCK = re.compile(r"^\..+\.lock$")


def remove_trash_of(out: Path) -> None:
    """Delete the trash directories beside out that clear_dir or staged_dir left when killed."""
    out = Path(out)
    trash = re.compile(rf"\.{re.escape(out.name)}\.[a-z0-9_]{{8}}\.old")  # this out's only
    if out.name and out.parent.is_dir():
        for path in out.parent.glob(f".{glob.escape(out.name)}.*.old"):
            if trash.fullmatch(path.name) and path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)


def contents(folder: Path) -> list[Path]:
    """What folder holds, leaving out the temp files and trash of interrupted writes (and the
    lock files of runs into its subfolders)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return [p for p in folder.iterdir() if not (is_leftover(p) or _is_lock_file(p))]


def is_leftover(path: Path) -> bool:
    """Whether path is named as a temp file or trash directory of attnlab's writes."""
    return _LEFTOVER.fullmatch(Path(path).name) is not None


def _is_lock_file(path: Path) -> bool:
    """Whether path is named and made as the lock file of an output directory (lock_out_dir)."""
    path = Path(path)
    return _LOCK.fullmatch(path.name) is not None and path.is_file() and not path.is_symlink()


def remove_leftovers(folder: Path) -> None:
    """Delete the temp files and trash directories a killed run left in folder (not below)."""
    if Path(folder).is_dir():
        for path in Path(folder).iterdir():
            if is_leftover(path):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)


@contextmanager
def staged_dir(out: Path, overwrite: bool = False, flag: str = "--out") -> Iterator[Path]:
    """Yield a temp directory beside out; on success it replaces out as a whole, else it vanishes.

    flag names out in messages, as in check_out_dir.
    """
    out = Path(out)
    check_out_dir(out, overwrite, flag=flag)
    if out.is_symlink():  # the folder it names is replaced, the link stays
        out = resolved_path(out, flag)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = _temp_name(out)
    try:
        stage.mkdir()
    except OSError as err:  # a read-only disk: the user named out, never the stage
        raise_for_target(err, stage, out)
        raise
    try:
        yield stage
    except BaseException as err:
        shutil.rmtree(stage, ignore_errors=True)
        raise_for_target(err, stage, out)
        raise
    if not overwrite:
        try:  # atomic onto nothing or an empty folder; refused by the system onto files
            os.replace(stage, out)
            return
        except OSError:
            if contents(out):  # written by another command since the check above
                shutil.rmtree(stage, ignore_errors=True)
                how = "--overwrite" if flag.startswith("--") else "overwrite=True"
                raise AttnlabError(
                    f"{flag} {out} was filled by another command while this one ran: "
                    f"nothing was replaced (pass {how} to replace it)"
                ) from None
    if out.exists():
        trash = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".old"))
        os.replace(out, trash / "old")
        os.replace(stage, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(stage, out)


_held = threading.local()  # the lock files this thread holds (or tried), for nested calls


@contextmanager
def lock_out_dir(out: Path, flag: str = "--out") -> Iterator[bool]:
    """Keep out to this process while the block runs: an AttnlabError if another process has it.

    Yields whether out is locked: where no lock can be had (a file system without locks, a
    folder without write access) it goes on unlocked, saying so on stderr. The kernel drops
    the lock of a process that dies, even by SIGKILL: a killed run never blocks the next one.
    Nested in one thread, for the same out, the inner block only joins the outer one.
    """
    out = Path(out)
    # No flock (Windows), or no folder of its own (check_out_location refuses it): no lock
    if fcntl is None or out.name in ("", ".", ".."):
        yield False
        return
    where = resolved_path(out, flag)  # one lock however out is spelled (a link, ../)
    lock = where.with_name(f".{where.name}.lock")
    held: dict[Path, bool] = getattr(_held, "locks", {})
    if lock in held:
        yield held[lock]
        return
    made = [p for p in (where.parent, *where.parent.parents) if not p.exists()][::-1]
    fd = _acquire_lock(lock, out, flag)
    _held.locks = {**held, lock: fd is not None}
    try:
        yield fd is not None
    finally:
        _held.locks = held
        if fd is not None:
            with suppress(OSError):  # while still held: a waiting process retries (_acquire_lock)
                if _names_file(lock, fd):
                    lock.unlink()
            os.close(fd)
        for folder in reversed(made):  # the folders made for the lock file, if left empty
            with suppress(OSError):
                folder.rmdir()


def _acquire_lock(lock: Path, out: Path, flag: str) -> int | None:
    """A descriptor of lock, locked by this process; None where it cannot be locked at all."""
    for _ in range(100):  # a retry each time the lock file goes as it is opened: a few at most
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
        except OSError:  # out cannot be made (a path through a file): the out checks say so
            return None
        try:
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
            except PermissionError:  # another user's lock file: read access is enough to lock
                fd = os.open(lock, os.O_RDONLY)
        except FileNotFoundError:  # its folder was removed meanwhile (its maker's run ended)
            continue
        except OSError as err:
            _say_unlocked(out, flag, err.strerror or str(err))
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise AttnlabError(
                f"another run{holder} is training in {out}: wait for it to end or choose "
                f"another {flag}"
            ) from None
        except OSError as err:  # ENOLCK, EOPNOTSUPP: a file system without locks
            os.close(fd)
            _say_unlocked(out, flag, err.strerror or str(err))
            return None
        if _names_file(lock, fd):
            with suppress(OSError):  # read-only (another user's file): no pid to show
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
            return fd
        os.close(fd)  # its holder ended and unlinked it after we opened it: open the new one
    _say_unlocked(out, flag, f"{lock} keeps being replaced")  # inode numbers that change?
    return None


def _names_file(path: Path, fd: int) -> bool:
    """Whether path is still the file open as fd (not unlinked, nor replaced)."""
    try:
        found, held = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino)


def _holder(fd: int) -> str:
    """' (pid N)', or ' (pid N on HOST)' from another machine, as the holder wrote it; else ''."""
    try:
        pid, host = os.pread(fd, 256, 0).decode("utf-8").split()
    except (OSError, UnicodeDecodeError, ValueError):  # not written yet
        return ""
    if not pid.isdigit():
        return ""
    return f" (pid {pid})" if host == socket.gethostname() else f" (pid {pid} on {host})"


def _say_unlocked(out: Path, flag: str, reason: str) -> None:
    """Tell that out goes unlocked, and why."""
    print(
        f"note: {flag} {out} cannot be locked ({reason}): nothing keeps another run from "
        "writing to it at the same time",
        file=sys.stderr,
    )
