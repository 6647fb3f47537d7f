"""Transport: how bytes move between ranks (frames and their MAC, listeners, TCP peers and the ring's exchange loop,
compiled or in Python, shared memory on one host, addresses and the rendezvous). Knows buffers and peers, not
collectives. Imports only the core's ground floor (errors, settings, jobenv, backend, reduce)."""
