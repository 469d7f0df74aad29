"""What every actor needs to build its engine, and the offload folder each actor claims.

The spec is small and picklable: Ray ships it to every actor, which builds its own LLM from it.
The policy travels as a dict, searched once on the driver (`--policy auto`), so every engine
runs the same placement and nothing is searched per actor.
"""
from __future__ import annotations

import fcntl
import itertools
import os
from dataclasses import dataclass, field

import torch

from flexsarathi.engine.running_fit import policy_or_default
from policy_search.policy import Policy


@dataclass(frozen=True)
class EngineSpec:
    model: str  # checkpoint folder (the same path on every node) or dummy:<name>
    policy: dict  # Policy.to_dict()
    hardware: dict | None = None  # HardwareSpec.to_dict(): its memory limits are the tier budgets
    dtype: str | None = None
    device: str | None = None  # None: cuda where the actor was given a GPU, else cpu
    offload_dir: str | None = None  # a folder on each node; every actor claims its own sub-folder
    seed: int = 0
    options: dict = field(default_factory=dict)  # EngineConfig fields by name (cpu_matmul, compress_head)

    @classmethod
    def of(cls, model: str, policy: Policy | None, hardware=None, dtype=None, device=None,
           offload_dir: str | None = None, seed: int = 0, **options) -> "EngineSpec":
        policy = policy_or_default(policy, options)  # None: on each actor, as many running as its memory holds
        return cls(model=model, policy=policy.to_dict(),
                   hardware=hardware.to_dict() if hardware is not None else None,
                   dtype=None if dtype is None else str(dtype).removeprefix("torch."), device=device,
                   offload_dir=offload_dir, seed=seed, options=options)

    def build(self, offload_dir: str):
        """The LLM of one actor; offload_dir: the folder this actor claimed."""
        from flexsarathi.llm import LLM
        from policy_search import HardwareSpec

        hardware = HardwareSpec.from_dict(self.hardware) if self.hardware is not None else None
        return LLM(self.model, dtype=self.dtype, device=self.device, policy=Policy.from_dict(self.policy),
                   hardware=hardware, offload_dir=offload_dir, seed=self.seed, **self.options)


def job_dtype(dtype, checkpoint_dtype: torch.dtype, device, num_gpus: float) -> str:
    """The one compute dtype of a Ray job, resolved on the driver and shipped to every actor: an
    explicit dtype as given; auto on GPU actors (given GPUs, or device cuda) the checkpoint's half
    dtype, on CPU actors this machine's measured choice (flexsarathi/machine/dtype_choice.py). Resolved per
    actor instead, actors on unlike CPUs (or one measuring while its neighbours load the machine)
    could compute in different dtypes and the job's records would depend on where each ran."""
    from flexsarathi.engine.llm_engine import resolve_device, resolve_dtype

    if device is None:
        actor_device = torch.device("cuda" if num_gpus > 0 else "cpu")
    else:
        actor_device = resolve_device(device, check_available=False)  # the actors', not necessarily here
    return str(resolve_dtype(dtype, checkpoint_dtype, actor_device)).removeprefix("torch.")


def claim_offload_folder(base: str | None) -> tuple[str, int]:
    """(folder, lock fd): the first `<base>/actor-<k>` no live process holds. Engines sharing a
    node must not write one disk store at once; the lock dies with the process, so a restarted
    actor reclaims a folder and reuses the weights already placed there. Keep the fd open."""
    from flexsarathi.engine.llm_engine import DEFAULT_OFFLOAD_DIR

    base = base or DEFAULT_OFFLOAD_DIR
    os.makedirs(base, exist_ok=True)
    for k in itertools.count():
        folder = os.path.join(base, f"actor-{k}")
        fd = os.open(folder + ".lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return folder, fd
    raise AssertionError("unreachable")
