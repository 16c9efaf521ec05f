"""The trainer service: the controller loop, losses, FSDP2 and weight pushes."""
