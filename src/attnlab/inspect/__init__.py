"""Looking inside the models (M9): attention maps, the attention page, heatmaps, PE plots."""
