"""Seeing the governor: `governor top` (terminal), `governor dashboard` (local web page), `governor plot` (traces).

Both live views read the daemon's control socket (`watch`: the status after each tick, with the decisions made
since); neither talks to the loop or the engine, and the daemon itself serves no TCP.
"""
