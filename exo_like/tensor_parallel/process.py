"""The node's side of a tensor-parallel rank: the worker process it spawns (and kills), and the engine the node
drives, which forwards every call to that process. To the node's stage (scheduler, shard holder) a group member
is an ordinary Engine; only the leader's gets steps."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from exo_like.engines.activations import Activations
from exo_like.engines.base import Engine, check_cancel
from exo_like.engines.layer_speed import LayerRunner
from exo_like.engines.work import KVPoolSize, WorkItem
from exo_like.errors import ExoLikeError, InvalidRequestError
from exo_like.models.config import ModelArgs
from exo_like.models.shard import Shard
from exo_like.tensor_parallel.messages import (AllocateKV, Describe, Done, Failed, Load, Message, ProtocolError,
                                               Ready, Step, receive, send)
from exo_like.tensor_parallel.options import KEY_VARIABLE, WorkerOptions

log = logging.getLogger(__name__)

FORMATION_TIMEOUT = 120.0  # spawn, import the framework, meet the other ranks


class GroupBroken(ExoLikeError):
    """The group cannot run steps any more (a rank's process died, a collective failed): the node re-forms it and
    the stage's requests replay, as when a ring node is lost."""

    status = 503
    type = "service_unavailable"

    def __init__(self, message: str):
        super().__init__(message, code="node_unreachable")


class WorkerProcess:
    """A spawned worker and the socketpair to it. Its requests are answered in order, one at a time."""

    def __init__(self, options: WorkerOptions, key: bytes):
        ours, theirs = socket.socketpair()
        options.fd = theirs.fileno()
        options.parent = os.getpid()
        env = {**os.environ, KEY_VARIABLE: key.hex()}
        self.rank = options.rank
        inherited = (theirs.fileno(),) + ((options.listen_fd,) if options.listen_fd >= 0 else ())
        self.process = subprocess.Popen([sys.executable, "-m", "exo_like.tensor_parallel.worker",
                                         *options.to_argv()], pass_fds=inherited, env=env)
        theirs.close()
        self.channel = ours
        self.lock = threading.Lock()

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, timeout: float = FORMATION_TIMEOUT) -> Ready:
        self.channel.settimeout(timeout)
        try:
            message = receive(self.channel)
        except (EOFError, OSError, ProtocolError) as exc:
            self.kill()
            raise GroupBroken(f"rank {self.rank}'s worker did not form its group: {exc or 'timed out'}") from exc
        finally:
            if self.process.poll() is None:
                self.channel.settimeout(None)
        if not isinstance(message, Ready):
            self.kill()
            raise GroupBroken(f"rank {self.rank}'s worker sent {message.type} instead of ready")
        return message

    def call(self, message: Message) -> Done:
        with self.lock:
            try:
                send(self.channel, message)
                answer = receive(self.channel)
            except (EOFError, OSError, ProtocolError) as exc:
                raise GroupBroken(f"rank {self.rank}'s worker is gone ({self._exit()}): {exc}") from exc
        if isinstance(answer, Failed):
            if answer.fatal:
                raise GroupBroken(f"rank {self.rank}'s group broke: {answer.error}: {answer.message}")
            if answer.status == 400:
                raise InvalidRequestError(answer.message)
            error = ExoLikeError(answer.message)
            error.status = answer.status
            raise error
        if not isinstance(answer, Done):
            raise GroupBroken(f"rank {self.rank}'s worker answered {answer.type}")
        return answer

    def _exit(self) -> str:
        code = self.process.poll()
        return "still running" if code is None else f"exit code {code}"

    def kill(self) -> None:
        """SIGKILL: the one exit that works from inside a blocked collective."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.channel.close()


class GroupMemberEngine(Engine):
    """This node's rank of a tensor-parallel group, run by `worker`. `local`: an unloaded engine of the same kind
    in this process, which measures layers for the planner (nothing of it is loaded for serving)."""

    def __init__(self, worker: WorkerProcess, ready: Ready, local: Engine):
        super().__init__(local.requested_device, local.requested_dtype)
        self.worker, self.local = worker, local
        self.name = ready.engine
        self._ready = ready
        self._figures: dict = {}

    def load(self, model_dir: Path, args: ModelArgs, shard: Shard, cancel: threading.Event | None = None) -> None:
        if shard.tp is None or shard.tp.rank != self.worker.rank:
            raise ValueError(f"{shard} is not rank {self.worker.rank}'s part of a tensor-parallel group")
        check_cancel(cancel)
        self.shard = self.args = None
        self._figures = self.worker.call(Load(str(model_dir), args, shard)).values
        self.shard, self.args = shard, args
        check_cancel(cancel)

    def step(self, items: Sequence[WorkItem], inputs: np.ndarray | Activations) -> Activations | np.ndarray:
        output = self.worker.call(Step(tuple(items), inputs)).output
        assert output is not None
        return output

    def allocate_kv(self, n_blocks: int, n_window_blocks: int | None = None) -> None:
        self._figures = self.worker.call(AllocateKV(n_blocks, n_window_blocks)).values
        self._log_pool(self.kv_size)

    def kv_block_bytes(self) -> tuple[int, int]:
        full, windowed = self._figures["kv_block_bytes"]
        return int(full), int(windowed)

    @property
    def kv_size(self) -> KVPoolSize | None:
        size = self._figures.get("kv_size")
        return None if size is None else KVPoolSize(*size)

    def parameter_bytes(self) -> int:
        return int(self._figures.get("parameter_bytes", 0))

    def refresh(self) -> None:
        self._figures = self.worker.call(Describe()).values

    def layer_form(self, model_dir: Path, args: ModelArgs) -> str:
        return self.local.layer_form(model_dir, args)

    def layer_runner(self, model_dir: Path, args: ModelArgs) -> LayerRunner:
        return self.local.layer_runner(model_dir, args)

    def close(self) -> None:
        self.worker.kill()

    @property
    def device_name(self) -> str:
        return self._ready.device_name

    @property
    def on_cpu(self) -> bool:
        return self._ready.on_cpu

    @property
    def dtype_name(self) -> str:
        return str(self._figures.get("dtype_name") or self.local.dtype_name)

    def numerics(self) -> dict[str, str]:
        return dict(self._figures.get("numerics") or {})
