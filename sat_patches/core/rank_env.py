"""The variables torchrun gives each of its workers, for ranks started on this machine without it."""
from __future__ import annotations


def torchrun_variables(rank: int, nranks: int, master_port: int, nodes: int = 1) -> dict:
    """Rank ``rank`` of ``nranks`` with the rendezvous on loopback at ``master_port``. ``nodes`` > 1: the ranks in
    consecutive blocks of ``nranks // nodes``, one block per node, with the node variables a ``torchrun --nnodes``
    agent gives its workers (``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_*``)."""
    if nodes < 1 or nranks % nodes:
        raise ValueError(f"{nranks} ranks do not split evenly over {nodes} node(s)")
    per_node = nranks // nodes
    variables = {"RANK": str(rank), "WORLD_SIZE": str(nranks), "LOCAL_RANK": str(rank % per_node),
                 "LOCAL_WORLD_SIZE": str(per_node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)}
    if nodes > 1:
        variables.update({"GROUP_RANK": str(rank // per_node), "GROUP_WORLD_SIZE": str(nodes),
                          "ROLE_NAME": "default", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nranks)})
    return variables
