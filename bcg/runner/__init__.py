"""Turns scheduled sequences into forward batches and runs the model on them."""
