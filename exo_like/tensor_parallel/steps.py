"""What the framework groups (torch_group.py, mlx_group.py) share: the leader hands each step to its followers
over their control channels; closing the group closes those channels (a follower then exits)."""

from __future__ import annotations

import socket
from collections.abc import Sequence

from exo_like.engines.activations import Activations
from exo_like.engines.tensor_group import TensorGroup
from exo_like.engines.work import WorkItem
from exo_like.tensor_parallel.messages import Follow, send


class SharedSteps(TensorGroup):
    followers: list[socket.socket]

    def share_step(self, items: Sequence[WorkItem], hidden: Activations) -> None:
        message = Follow(tuple(items), hidden)
        for follower in self.followers:
            send(follower, message)

    def close(self) -> None:
        for follower in self.followers:
            follower.close()
