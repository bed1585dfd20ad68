"""The wire format and placement: how a version is packed into chunks, moved
between hosts and placed."""
