"""Free ports for tests that start a job beside another framework's store."""


def free_port_beside(offset: int) -> int:
    """A free port P with P + offset free too when it was checked (our store's port beside
    another store's: + 1 beside torch's, - 1 below msrun's scheduler)."""
    import socket

    for _ in range(50):
        with socket.socket() as s, socket.socket() as beside:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            try:
                beside.bind(("127.0.0.1", port + offset))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free pair of ports P, P + {offset}")
