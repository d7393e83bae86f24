"""Live healing with torchft: a killed replica group rejoins with a live peer's weights while the others keep stepping.

labkit's restart path (:mod:`labkit.fault.recovery`) stops every worker and resumes all of them from the last
checkpoint. torchft (PyTorch's fault-tolerance library, the optional ``ft`` extra) heals one replica instead:

* **Replica groups** each keep a whole copy of the model (here one process each) and average their gradients in a
  process group that torchft rebuilds whenever the membership changes.
* **A per-step quorum**: before each step every group's ``Manager`` asks the **lighthouse** (a small server in the
  torchft wheel, started here on 127.0.0.1) who is alive. A group that stopped heartbeating is left out; the others
  go on stepping without it (the step the fault broke is not committed, so no group applies a half-averaged
  gradient).
* **Healing**: a group that (re)joins behind the others is told which live peer to copy; it fetches that peer's
  model and optimizer state over HTTP (torchft's ``HTTPTransport``) inside its first quorum and steps on with them.

:func:`heal_run` starts the lighthouse and the groups, SIGKILLs one group at a step, restarts it, and
:func:`recovery_split` reads the events every process wrote (``events.jsonl``, one clock) into the recovery's parts:

* ``detect_s``: the kill → a healthy group's first step that was not committed (its gradient allreduce failed) or
  went on without the victim (None if neither: the replacement was in the next quorum before it was missed);
* ``respawn_s``: the kill → the new process has built its model and Manager (the restart a supervisor does);
* ``quorum_s``: → the lighthouse put it in a quorum with the live groups (the weight transfer begins);
* ``transfer_s``: the live peer's state received; ``rejoin_s``: → its first committed step with every group;
* and the steps each healthy group committed between the kill and the rejoin.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch

HOST = "127.0.0.1"
TINY = {"vocab_size": 64, "block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 32}
M10 = {"vocab_size": 4096, "block_size": 64, "n_layer": 4, "n_head": 8, "n_embd": 416}  # 10.04M parameters


@dataclass
class HealSpec:
    """One healing run: ``replicas`` groups train; ``victim`` is SIGKILLed once it has committed ``kill_at`` steps and
    restarted after the others committed ``solo_steps`` steps without it (0: at once); every group stops
    ``steps_after`` steps after the victim rejoined (each at the same step, so their weights can be compared).
    ``standby``: the replacement process is started (its imports done) beforehand and told to go at the kill, as a
    supervisor with a warm spare does; without it the restart pays for a new Python process."""
    replicas: int = 2
    victim: int = 1
    kill_at: int = 8
    solo_steps: int = 3
    steps_after: int = 10
    standby: bool = False
    sync_every: int = 0  # 0: the gradients averaged every step (DDP); H: torchft's LocalSGD, weights averaged every H
    async_quorum: bool = True  # DDP: each step's quorum (and a heal) runs beside its forward and backward (torchft's
    #                            default), so the healthy groups step on while a peer heals; LocalSGD's is synchronous
    model: dict = field(default_factory=lambda: dict(TINY))
    batch: int = 4
    seed: int = 0
    min_step_s: float = 0.0  # each step takes at least this long: a tiny model's stand-in for a real one's compute
    heartbeat_timeout_ms: int = 1000  # the lighthouse drops a group this long after its last heartbeat
    timeout_s: float = 10.0  # a collective or a transfer that takes longer fails the step

    def check(self) -> None:
        """A clear error before any process starts."""
        if self.replicas < 2:
            raise ValueError(f"healing needs at least 2 replica groups (a live peer to copy); got {self.replicas}")
        if not 0 <= self.victim < self.replicas:
            raise ValueError(f"victim {self.victim} is not a replica group (0..{self.replicas - 1})")
        if self.sync_every < 0:
            raise ValueError(f"sync_every must be 0 (every step) or a number of local steps; got {self.sync_every}")
        if self.kill_at < 1 or self.solo_steps < 0 or self.steps_after < 1:
            raise ValueError(f"kill_at ({self.kill_at}) and steps_after ({self.steps_after}) must be at least 1, "
                             f"solo_steps ({self.solo_steps}) at least 0")
        os.environ.setdefault("RUST_LOG", "warn")  # before torchft loads: its Rust side logs every quorum at info
        try:
            import torchft  # noqa: F401
        except ImportError as error:
            raise RuntimeError("live healing needs torchft: pip install -e '.[ft]'") from error


def start_lighthouse(min_replicas: int = 1, heartbeat_timeout_ms: int = 1000):
    """torchft's lighthouse on 127.0.0.1 (in this process, on a free port). Returns (server, its address): the
    server's own ``address()`` names the host, which need not resolve; the address returned names 127.0.0.1."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind=f"{HOST}:0", min_replicas=min_replicas, join_timeout_ms=1000,
                              heartbeat_timeout_ms=heartbeat_timeout_ms)
    return server, f"http://{HOST}:{server.address().rsplit(':', 1)[1]}"


def digest(tensors) -> str:
    """sha256 of the tensors' bytes, in order: equal digests, bitwise equal weights."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class Events:
    """One JSON line per event, each stamped with ``time.time()`` (every process on the machine reads one clock)."""

    def __init__(self, path, **fields):
        self.file, self.fields = open(path, "a", encoding="utf-8"), fields

    def __call__(self, kind: str, **fields) -> None:
        self.file.write(json.dumps({"type": kind, "t": time.time(), **self.fields, **fields}) + "\n")
        self.file.flush()


def timed_transport(events: Events, timeout: timedelta):
    """torchft's HTTP checkpoint transport, recording each send (with the digest of the weights it serves) and each
    receive (its start, end and the digest of the weights it brought)."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class TimedHTTPTransport(HTTPTransport):
        def send_checkpoint(self, dst_ranks, step, state_dict, timeout):
            events("send", step=step, to=list(dst_ranks), digest=digest(state_dict["user"]["default"]["model"]))
            super().send_checkpoint(dst_ranks, step, state_dict, timeout)

        def recv_checkpoint(self, src_rank, metadata, step, timeout):
            began = time.time()
            state = super().recv_checkpoint(src_rank, metadata, step, timeout)
            events("recv", began=began, step=step, src=src_rank, digest=digest(state["user"]["default"]["model"]))
            return state

    return TimedHTTPTransport(timeout=timeout, num_chunks=0)


def replica_main(spec: HealSpec, replica: int, life: int, lighthouse: str, events_path: str) -> None:
    """One replica group of one process: a GPT, AdamW, and torchft's Manager around each step."""
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    from labkit.model.gpt import GPT, GPTShape

    run_dir = Path(events_path).parent
    model = GPT(GPTShape(**spec.model), init_seed=spec.seed)  # a rejoining group's weights come from a peer
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3)
    if life > 0:
        _wait_for(run_dir / "respawn")  # a standby waits here, its imports done and its model built
    woke = time.time()
    events = Events(events_path, replica=replica, life=life, pid=os.getpid())
    timeout = timedelta(seconds=spec.timeout_s)
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)  # this group's own store

    def state_dict():
        return {"model": params, "optim": opt.state_dict()}

    def load_state_dict(state):
        with torch.no_grad():
            for p, q in zip(params, state["model"]):
                p.copy_(q)
        opt.load_state_dict(state["optim"])

    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
                      min_replica_size=1, use_async_quorum=spec.async_quorum and not spec.sync_every,
                      replica_id=f"replica{replica}",
                      store_addr=HOST, store_port=store.port, rank=0, world_size=1, lighthouse_addr=lighthouse,
                      hostname=HOST, checkpoint_transport=timed_transport(events, timeout), timeout=timeout,
                      quorum_timeout=timedelta(seconds=60), connect_timeout=timeout)
    events("ready", params=sum(p.numel() for p in params), woke=woke)
    if life == 0:
        _wait_for(run_dir / "go")  # every group is up: the first quorum has them all
    if spec.sync_every:
        local_sgd_loop(spec, replica, manager, model, opt, events, run_dir)
    else:
        ddp_loop(spec, replica, manager, model, opt, events, run_dir)
    events("done", step=manager.current_step(), digest=digest(params))
    manager.shutdown(wait=False)


def ddp_loop(spec: HealSpec, replica: int, manager, model, opt, events: Events, run_dir: Path) -> None:
    """A quorum every step, the gradients averaged over the groups in it: torchft's fault-tolerant DDP.

    With ``spec.async_quorum`` the quorum runs while this step computes; a group healing in it sends zeros (torchft
    leaves it out of the average), receives the peer's state meanwhile, and ``should_commit`` loads it before the
    optimizer steps with the others' average: its first step lands on the peer's weights, the next one it shares.
    Without, ``start_quorum`` returns with the peer's weights loaded, and every group waits for the transfer."""
    params = list(model.parameters())
    while manager.current_step() < _stop_step(run_dir):
        began = time.time()
        manager.start_quorum()
        loss = local_loss(spec, replica, manager.current_step(), model)
        grads = torch.cat([p.grad.flatten() for p in params])
        manager.allreduce(grads).wait()  # an error is recorded by the manager: the step is then not committed
        committed = manager.should_commit()
        if committed:
            torch.nn.utils.vector_to_parameters(grads, [p.grad for p in params])  # the average, back in place
            opt.step()
        events("step", step=manager.current_step(), committed=committed, participants=manager.num_participants(),
               loss=loss)
        time.sleep(max(0.0, spec.min_step_s - (time.time() - began)))


def local_sgd_loop(spec: HealSpec, replica: int, manager, model, opt, events: Events, run_dir: Path) -> None:
    """torchft's LocalSGD: ``sync_every`` local optimizer steps, then a quorum and the weights averaged over the groups
    in it (inside ``opt.step()``). ``step`` events are the syncs (the manager counts those), ``local`` events the
    steps between them. A group lost between syncs loses its own local steps; the others' sync goes on without it."""
    from torchft.local_sgd import LocalSGD

    local_step = 0
    with LocalSGD(manager, model, opt, sync_every=spec.sync_every) as local:
        while manager.current_step() < _stop_step(run_dir):
            began, synced = time.time(), manager.current_step()
            loss = local_loss(spec, replica, synced * spec.sync_every + local_step, model)
            opt.step()  # the sync_every-th step also syncs
            local_step += 1
            events("local", sync=synced, local_step=local_step, loss=loss)
            if local._local_step == 0:  # this step synced
                events("step", step=manager.current_step(), committed=manager.current_step() > synced,
                       participants=manager.num_participants(), local_steps=local_step)
                local_step = 0
            time.sleep(max(0.0, spec.min_step_s - (time.time() - began)))


def local_loss(spec: HealSpec, replica: int, step: int, model) -> float:
    """The gradients of one batch of group ``replica``'s data at ``step`` (left in ``.grad``); returns the loss."""
    ids = batch(spec, replica, step)
    model.zero_grad()
    _, loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return loss.item()


def _wait_for(path: Path) -> None:
    while not path.exists():
        time.sleep(0.005)


def _stop_step(run_dir: Path) -> float:
    """The step every group stops at: written by the driver once the victim rejoined; until then, none."""
    text = (run_dir / "stop").read_text() if (run_dir / "stop").exists() else ""
    return int(text) if text.strip() else float("inf")


def batch(spec: HealSpec, replica: int, step: int) -> torch.Tensor:
    """Group ``replica``'s tokens at ``step``: its own shard of the data, the same however often it restarts."""
    g = torch.Generator().manual_seed(spec.seed * 1_000_003 + replica * 10_007 + step)
    return torch.randint(spec.model["vocab_size"], (spec.batch, spec.model["block_size"] + 1), generator=g)


def read_events(path) -> list[dict]:
    lines = Path(path).read_text(encoding="utf-8").splitlines() if Path(path).exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def heal_run(spec: HealSpec, run_dir, timeout_s: float = 300.0, poll_s: float = 0.02) -> dict:
    """Start the lighthouse and the groups, kill and restart the victim, wait for all to finish. Returns
    :func:`recovery_split`'s record with the driver's own events (kill, respawn) among the workers'."""
    spec.check()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    events_path = run_dir / "events.jsonl"
    driver = Events(events_path, replica=None)
    server, address = start_lighthouse(heartbeat_timeout_ms=spec.heartbeat_timeout_ms)
    env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
    procs = {r: _spawn(spec, r, 0, address, run_dir, env) for r in range(spec.replicas)}
    spare = _spawn(spec, spec.victim, 1, address, run_dir, env) if spec.standby else None
    deadline, killed_at, respawned, stopping = time.monotonic() + timeout_s, None, False, False
    try:
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            events = read_events(events_path)
            if sum(e["type"] == "ready" and e["life"] == 0 for e in events) == spec.replicas:
                (run_dir / "go").touch()
            steps = [e for e in events if e["type"] == "step" and e["committed"]]
            if killed_at is None and any(_kill_now(spec, e) for e in events):
                os.kill(procs[spec.victim].pid, signal.SIGKILL)
                procs[spec.victim].wait()
                killed_at = time.time()  # after the wait: the victim is gone
                driver("kill", victim=spec.victim, at=killed_at)
            solo = [e for e in steps if killed_at and e["t"] > killed_at and e["replica"] != spec.victim]
            if killed_at and not respawned and len(solo) >= spec.solo_steps * (spec.replicas - 1):
                procs[spec.victim] = spare or _spawn(spec, spec.victim, 1, address, run_dir, env)
                (run_dir / "respawn").touch()
                driver("respawn", victim=spec.victim)
                respawned = True
            if respawned and not stopping and any(e.get("life") == 1 and e["participants"] == spec.replicas
                                                  for e in steps):
                (run_dir / "stop").write_text(str(max(e["step"] for e in steps) + spec.steps_after))
                stopping = True
            time.sleep(poll_s)
    finally:
        for p in [*procs.values(), *([spare] if spare else [])]:
            if p.poll() is None:
                p.kill()
                p.wait()
        server.shutdown()
    codes = {r: p.returncode for r, p in procs.items()}
    if any(codes.values()) or not respawned:
        tail = "".join((run_dir / f"replica{r}.log").read_text()[-2000:] for r in procs)
        raise RuntimeError(f"healing run failed (exit codes {codes}, restarted: {respawned}; see {run_dir}):\n{tail}")
    return recovery_split(read_events(events_path), spec)


def _kill_now(spec: HealSpec, e: dict) -> bool:
    """Whether event ``e`` is the victim's moment: it has committed ``kill_at`` steps (syncs, under LocalSGD), and under
    LocalSGD it is halfway to its next sync."""
    if e["replica"] != spec.victim:
        return False
    if spec.sync_every:
        return e["type"] == "local" and e["sync"] >= spec.kill_at and e["local_step"] == max(1, spec.sync_every // 2)
    return e["type"] == "step" and e["committed"] and e["step"] >= spec.kill_at


def _spawn(spec: HealSpec, replica: int, life: int, lighthouse: str, run_dir: Path, env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "labkit.fault.heal", "--spec", json.dumps(asdict(spec)), "--replica", str(replica),
           "--life", str(life), "--lighthouse", lighthouse, "--events", str(run_dir / "events.jsonl")]
    with open(run_dir / f"replica{replica}.log", "a") as log:  # torchft's and torch's warnings go here
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def recovery_split(events: list[dict], spec: HealSpec) -> dict:
    """The recovery's parts (the module's docstring), from the events of one :func:`heal_run`."""
    kill = next(e["at"] for e in events if e["type"] == "kill")
    steps = [e for e in events if e["type"] == "step"]
    healthy = [e for e in steps if e["replica"] != spec.victim and e["t"] > kill]
    reborn = [e for e in events if e["replica"] == spec.victim and e.get("life") == 1]
    ready = next(e["t"] for e in reborn if e["type"] == "ready")
    recv = next(e for e in reborn if e["type"] == "recv")
    rejoin = next(e for e in reborn if e["type"] == "step" and e["committed"] and e["participants"] == spec.replicas)
    rejoined = rejoin["t"]
    sent = next(e for e in events if e["type"] == "send" and e["t"] > kill and e["step"] == recv["step"])
    # None: the healthy groups never saw it (the replacement was in their next quorum before the victim was missed)
    detect = next((e["t"] for e in healthy if not e["committed"] or e["participants"] < spec.replicas), None)
    window = [e for e in healthy if e["step"] < rejoin["step"]]  # before the first step they took together again
    done = {e["replica"]: e["digest"] for e in events if e["type"] == "done"}
    lost = _victim_local_steps_lost(events, spec, kill, recv) if spec.sync_every else None
    return {"detect_s": None if detect is None else detect - kill, "respawn_s": ready - kill,
            "quorum_s": recv["began"] - ready,
            "transfer_s": recv["t"] - recv["began"], "rejoin_s": rejoined - recv["t"], "total_s": rejoined - kill,
            "healthy_steps_meanwhile": sum(e["committed"] for e in window) / (spec.replicas - 1),
            "healthy_steps_dropped": sum(not e["committed"] for e in window),
            "healthy_longest_gap_s": _longest_gap([kill] + [e["t"] for e in window if e["committed"]] + [rejoined]),
            "healed_at_step": recv["step"], "healed_equal_to_sender": recv["digest"] == sent["digest"],
            "final_equal": len(set(done.values())) == 1 and len(done) == spec.replicas,
            "final_step": max(e["step"] for e in steps), "victim_local_steps_lost": lost,
            "params": next(e["params"] for e in reborn if e["type"] == "ready")}


def _victim_local_steps_lost(events: list[dict], spec: HealSpec, kill: float, recv: dict) -> int:
    """Under LocalSGD: the victim's local steps since its last sync when it was killed, and those its new process took
    before the heal overwrote them."""
    mine = [e for e in events if e["replica"] == spec.victim and e["type"] == "local"]
    before = [e for e in mine if e["life"] == 0 and e["t"] < kill]
    after = [e for e in mine if e["life"] == 1 and e["t"] < recv["t"]]
    return (before[-1]["local_step"] if before else 0) + len(after)


def _longest_gap(times: list[float]) -> float:
    times = sorted(times)
    return max(b - a for a, b in zip(times, times[1:]))


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(description="one torchft replica group (started by heal_run)")
    parser.add_argument("--spec", required=True)
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--life", type=int, default=0)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--events", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    replica_main(HealSpec(**json.loads(args.spec)), args.replica, args.life, args.lighthouse, args.events)


if __name__ == "__main__":
    main()
