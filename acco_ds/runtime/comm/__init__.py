"""The communication side: the communication thread, collectives, compression and process groups."""
