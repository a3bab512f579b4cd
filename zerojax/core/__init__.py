"""What every other layer reads: the options, each leaf's layout and each model call's plan,
meshes, the error categories and the trace scope."""
