"""DDP communication (docs/training.md): PyTorch's gradient hooks of `trainer_config.ddp_comm_hook`,
LocalSGD's model averaging, and each rank's own state of them in the snapshot."""

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import (
    default_hooks,
    post_localSGD_hook,
    powerSGD_hook,
)
from torch.distributed.algorithms.model_averaging import averagers
from torch.distributed.algorithms.model_averaging import utils as averaging_utils
from torch.nn.parallel import DistributedDataParallel as DDP

from mingpt import torch_fixes
from mingpt.config import ConfigError, TrainerConfig
from mingpt.distributed import DistInfo, all_gather

log = logging.getLogger(__name__)


class CommHook:
    """The hook `name` (none, fp16, bf16: nothing kept); a subclass keeps each rank's `own_state`
    for a resume."""

    ddp_options: dict[str, Any] = {}  # extra keyword arguments for DistributedDataParallel
    # what the state saved per rank is shaped by, beside the hook and the number of ranks
    settings: dict[str, Any] = {}
    # the ranks' weights and optimizer states differ (LocalSGD): the snapshot takes rank 0's
    replicas_differ = False

    def __init__(self, dist_info: DistInfo, name: str):
        self.dist = dist_info
        self.name = name

    def start(
        self,
        ddp: DDP | None,
        saved: dict[str, Any] | None,
        step: int,
        model: torch.nn.Module,
        optimizer,
        scaler,
        warm_up: Callable[[], None],
    ) -> None:
        """Restore the state `saved` and register the hook on `ddp` (None in one process), to go on
        at `step`; from now on the hook works on `model` (not its DDP wrapper), `optimizer` and
        `scaler`. `warm_up` runs one plain DDP step on a training batch and drops its gradients."""
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        same_hook = (
            saved
            and saved.get("name") == self.name
            and saved.get("world_size") == self.dist.world_size
        )
        # A setting the snapshot does not record (written before it was saved) is taken as this
        # run's.
        same_settings = (
            same_hook and {**self.settings, **saved.get("settings", {})} == self.settings
        )
        if same_settings and saved.get("state") is not None:
            self.load_own_state(saved["state"], warm_up)
        elif same_hook and not same_settings and self.dist.is_main_process:
            log.warning(
                "the snapshot's %s state was built with %s; this run has %s: that state starts "
                "afresh at step %d, from the snapshot's weights",
                self.name,
                saved.get("settings"),
                self.settings,
                step,
            )
        elif saved and self.dist.is_main_process:  # another number of processes or another hook
            this = "1 process (no comm hook)"
            if self.dist.world_size > 1:
                this = f"{self.dist.world_size} ranks with ddp_comm_hook={self.name}"
            weights = ""
            if saved.get("name") == "post_local_sgd":
                weights = " (the replicas' mean) and rank 0's optimizer state"
            log.warning(
                "the snapshot's %s state is per rank, for %s ranks; this run has %s: that state "
                "starts afresh at step %d, from the snapshot's weights%s",
                saved.get("name"),
                saved.get("world_size"),
                this,
                step,
                weights,
            )
        self.register(ddp, step)

    def register(self, ddp: DDP | None, step: int) -> None:
        """Register the hook on `ddp`, its state restored or fresh, to go on at `step`."""
        if self.name != "none":
            ddp.register_comm_hook(None, getattr(default_hooks, f"{self.name}_compress_hook"))

    def after_optimizer_step(self) -> None:
        pass

    @contextlib.contextmanager
    def mean_weights(self) -> Iterator[None]:
        """While in the body, the model holds the weights that stand for the run (here: its own)."""
        yield

    def model_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """`state`, the model's state dict, with the weights that stand for the run (collective: on
        every rank)."""
        return state

    def own_state(self) -> dict[str, Any] | None:
        """This rank's own state for the snapshot, or None."""
        return None


class PowerSGD(CommHook):
    def __init__(self, name: str, cfg: TrainerConfig, dist_info: DistInfo):
        super().__init__(dist_info, name)
        self.state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=cfg.powersgd_rank,
            start_powerSGD_iter=cfg.powersgd_start_step,
        )
        self.hook = torch_fixes.powersgd_hook(
            name == "batched_powersgd", dist_info.device.type == "cuda"
        )
        # P and Q have powersgd_rank columns; a compiled backward, and one under autocast, produce
        # the gradients in another order, which the error feedback's bucket is laid out in.
        self.settings = {
            "powersgd_rank": cfg.powersgd_rank,
            "compile": cfg.compile,
            "autocast": cfg.amp_on(dist_info.device.type),
        }
        if dist_info.backend == "gloo":
            # One bucket: with several, gloo can pair the ranks' PowerSGD all-reduces
            # wrongly (docs/training.md).
            self.ddp_options = {"bucket_cap_mb": 2**20}

    def own_state(self):
        s = self.state
        # numpy's Mersenne Twister: Q's random starts
        mt = s.rng.get_state(legacy=False)
        return {
            "iter": s.iter,
            "error": s.error_dict,
            "p": s.p_memory_dict,
            "q": s.q_memory_dict,
            # the error feedback's unit (None: 1, no gradient scaler)
            "scale": self.scale,
            "rng": {
                "keys": torch.from_numpy(mt["state"]["key"].astype("int64")),
                "pos": int(mt["state"]["pos"]),
                "has_gauss": int(mt["has_gauss"]),
                "cached_gaussian": float(mt["gauss"]),
            },
        }

    def register(self, ddp, step):
        # from its first step: powersgd_start_step plain steps
        ddp.register_comm_hook(self.state, self.hook)
        # fp16: the loss scale of the next step's gradients, the unit its error feedback is kept in
        self.scale = None
        if self.scaler.is_enabled():
            self.scale = self.scaler.get_scale()

    def after_optimizer_step(self) -> None:
        """With fp16's gradient scaler: a step it skipped had gradients that were not finite, and
        they went into the error feedback and the warm-start P and Q; kept, they made every later
        gradient NaN and the scaler skip every later step, in silence. They start afresh (as at the
        first compressed step, the same on every rank: the gradients were all-reduced). A scale
        that grew multiplies the error feedback with it: it is added to gradients of that scale."""
        if self.scale is None:
            return
        # the host learns the scale once per step; the hook synchronizes each bucket on CUDA anyway
        scale = self.scaler.get_scale()
        s = self.state
        # The scaler backs off only after gradients that were not finite.
        if scale < self.scale:
            s.error_dict.clear()
            s.p_memory_dict.clear()
            s.q_memory_dict.clear()
        elif scale > self.scale and s.error_dict:
            torch._foreach_mul_(list(s.error_dict.values()), scale / self.scale)
        self.scale = scale

    def load_own_state(self, own, warm_up):
        s = self.state
        if own["iter"] >= s.start_powerSGD_iter:
            # The saved error and P/Q are laid out in DDP's rebuilt buckets (gradients in the order
            # backward produces them), which a new DDP only has from its second iteration on: one
            # plain step rebuilds them.
            warm_up()
        s.iter = own["iter"]
        rng = own["rng"]
        s.rng.set_state(
            {
                "bit_generator": "MT19937",
                "state": {"key": rng["keys"].numpy().astype("uint32"), "pos": rng["pos"]},
                "has_gauss": rng["has_gauss"],
                "gauss": rng["cached_gaussian"],
            }
        )
        device = self.dist.device
        for key, name in (("error", "error_dict"), ("p", "p_memory_dict"), ("q", "q_memory_dict")):
            setattr(s, name, {k: v.to(device) for k, v in own[key].items()})
        # The error feedback goes into this run's unit: fp16's gradient scaler switched on or off
        # since the snapshot (amp_dtype changed) added errors of the other unit, up to 65536 times
        # too large, to every gradient.
        unit = 1.0
        if self.scaler.is_enabled():
            unit = self.scaler.get_scale()
        saved = own.get("scale", unit) or 1.0  # not saved before: taken as this run's
        if saved != unit:
            torch._foreach_mul_(list(s.error_dict.values()), unit / saved)


class PostLocalSGD(CommHook):
    replicas_differ = True

    def __init__(self, cfg: TrainerConfig, dist_info: DistInfo):
        super().__init__(dist_info, "post_local_sgd")
        subgroup = None
        if cfg.localsgd_group == "node":
            # A node's ranks all-reduce their gradients every step; torchrun numbers them
            # contiguously, as new_subgroups groups them.
            subgroup, _ = dist.new_subgroups(group_size=dist_info.local_world_size)
            if dist_info.local_world_size == dist_info.world_size and dist_info.is_main_process:
                log.warning(
                    "trainer_config.localsgd_group=node on one node: every rank still all-reduces "
                    "every step, so local SGD only adds the averaging "
                    "(localsgd_group=rank lets ranks diverge)"
                )
        self.state = post_localSGD_hook.PostLocalSGDState(
            None,
            subgroup,
            cfg.localsgd_start_step,
            post_local_gradient_allreduce=subgroup is not None,
        )
        self.averager = averagers.PeriodicModelAverager(
            cfg.localsgd_period, warmup_steps=cfg.localsgd_start_step
        )
        self.holds_mean = False  # in mean_weights: the model holds the replicas' mean

    def after_optimizer_step(self) -> None:
        # Before the gradients are cleared: the averager skips parameters without one.
        self.averager.average_parameters(self.model.parameters())

    def _mean(self) -> dict[str, torch.Tensor]:
        """{name: the ranks' mean} of each parameter, computed aside: the replicas stay as is."""
        named = self.model.named_parameters(remove_duplicate=False)
        mean = {name: p.detach().clone() for name, p in named}
        # the averager's own arithmetic
        averaging_utils.average_parameters(iter(mean.values()), dist.group.WORLD)
        return mean

    @contextlib.contextmanager
    def mean_weights(self):
        named = list(self.model.named_parameters(remove_duplicate=False))
        own = {name: p.data for name, p in named}
        mean = self._mean()
        for name, p in named:
            p.data = mean[name]
        self.holds_mean = True
        try:
            yield
        finally:
            self.holds_mean = False
            for name, p in named:
                p.data = own[name]

    def model_state(self, state):
        # The best weights, saved where they were evaluated: averaged again, the mean moved by an
        # ulp where the world size is no power of 2.
        if self.holds_mean:
            return state
        return {**state, **self._mean()}

    def own_state(self):
        return {
            "model_state": self.model.state_dict(),
            "optimizer_state": self.optimizer.state_dict()["state"],
            "scaler_state": self.scaler.state_dict(),
        }

    def register(self, ddp, step):
        # Both count optimizer steps: the hook all-reduces before localsgd_start_step,
        # the averager averages after it.
        self.state.iter = step
        self.averager.step = step
        ddp.register_comm_hook(self.state, post_localSGD_hook.post_localSGD_hook)

    def load_own_state(self, own, warm_up):
        # The state's CPU tensors go to where each one is.
        self.model.load_state_dict(own["model_state"])
        # This run's hyperparameters, the rank's own moments.
        optimizer = self.optimizer
        optimizer.load_state_dict({**optimizer.state_dict(), "state": own["optimizer_state"]})
        if self.scaler.is_enabled() and own["scaler_state"]:
            self.scaler.load_state_dict(own["scaler_state"])


def create(cfg: TrainerConfig, dist_info: DistInfo) -> CommHook:
    """The hook `trainer_config.ddp_comm_hook` names; a single process has none. A hook this run
    cannot use is refused, before any work."""
    name = cfg.ddp_comm_hook if dist_info.is_distributed else "none"
    # as for a key without effect (config.keys_without_effect): a user expects the hook to act
    if name != cfg.ddp_comm_hook:
        log.warning(
            "trainer_config.ddp_comm_hook=%s has no effect in one process: it acts on what the "
            "ranks of a run under torchrun communicate",
            cfg.ddp_comm_hook,
        )
    if name == "bf16" and dist_info.backend != "nccl":
        raise ConfigError(
            "trainer_config.ddp_comm_hook: bf16 compression needs the NCCL backend (CUDA); "
            f"this run uses {dist_info.backend}: use fp16, powersgd or none"
        )
    if name == "post_local_sgd" and cfg.localsgd_group == "node":
        # Every node's count, on every rank: one node's own can divide the world size while
        # another's differs (nodes of 1, 1 and 2 processes), and ranks that build subgroups of
        # different sizes hang at the first averaging; refused on some nodes only, the others
        # waited for them.
        sizes = sorted(set(all_gather(dist_info, dist_info.local_world_size)))
        if len(sizes) > 1 or dist_info.world_size % sizes[0]:
            raise ConfigError(
                "trainer_config.localsgd_group: node needs the same number of processes on every "
                f"node ({dist_info.world_size} ranks; processes per node: "
                f"{', '.join(map(str, sizes))})"
            )
    if name in ("powersgd", "batched_powersgd"):
        return PowerSGD(name, cfg, dist_info)
    if name == "post_local_sgd":
        return PostLocalSGD(cfg, dist_info)
    return CommHook(dist_info, name)
