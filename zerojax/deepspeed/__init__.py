"""DeepSpeed's JSON read into zerojax's options, and its optimizer and scheduler blocks as optax."""
