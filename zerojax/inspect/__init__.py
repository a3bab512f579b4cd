"""What a compiled step costs, read from its program: memory, collectives, FLOPs, the
schedule's overlap, what is alive at the peak, and where each leaf lives."""
