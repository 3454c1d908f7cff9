"""The op and direction codes of the schedule tables (``schedules``, ``simulate``)."""

IDLE, F, B, W, BW = 0, 1, 2, 3, 4
# Where an op's result goes (``Schedule.send``): nowhere, down the pipe (stage s -> s+1, a ring
# when a device holds several chunks), up (s -> s-1), or to the same device's next tick.
NOWHERE, DOWN, UP, SELF = 0, 1, 2, 3
