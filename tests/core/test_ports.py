"""Rendezvous ports come from below the kernel's ephemeral range, where no outgoing connection can take one
between the choice and the rendezvous's bind."""
import socket

from sat_patches.core import ports


def test_the_port_is_free_and_below_the_ephemeral_range():
    low, _ = ports.ephemeral_range()
    chosen = {ports.free_port() for _ in range(20)}
    assert all(low - ports.SPAN <= p < low for p in chosen), sorted(chosen)
    assert len(chosen) > 1                                   # random: concurrent jobs rarely meet
    for port in chosen:
        with socket.socket() as s:
            s.bind(("", port))


def test_a_port_in_use_is_never_chosen(monkeypatch):
    low, _ = ports.ephemeral_range()
    taken = socket.socket()
    taken.bind(("", low - 1))
    monkeypatch.setattr(ports, "SPAN", 2)                    # the candidates: low - 2 and the taken low - 1
    try:
        assert {ports.free_port() for _ in range(10)} == {low - 2}
    finally:
        taken.close()
