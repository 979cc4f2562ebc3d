"""Free ports for tests that start a job beside another framework's store."""


def free_port_beside(offset: int, host: str = "127.0.0.1") -> int:
    """A free port P on `host` with P + offset free too when it was checked (our store's port
    beside another store's: + 1 beside torch's, - 1 below msrun's scheduler; a multi-node job's
    store on MASTER_PORT + 1)."""
    import socket

    for _ in range(50):
        with socket.socket() as s, socket.socket() as beside:
            s.bind((host, 0))
            port = s.getsockname()[1]
            try:
                beside.bind((host, port + offset))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free pair of ports P, P + {offset}")
