"""The jitted step: the user's call checked and traced, its model calls run once per device
with ZeRO's collectives, and the managed update."""
