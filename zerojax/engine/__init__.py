"""The jitted step, built from values: the `Placement` a zero resolves, the user's call checked
and traced per compile key (`Variant`), its model calls run once per device with ZeRO's
collectives (`hook`), the managed update of `zerojax.update` applied inside it."""
