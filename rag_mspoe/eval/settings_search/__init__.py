"""The settings search behind `rag-mspoe calibrate`: fits a method to one model (layer factors, a
static Ms-PoE head order, the positional hidden dimension) by running sweeps. Each produces a
method config to save next to the model; the configs that ship are in `rag_mspoe.calibrated`."""
