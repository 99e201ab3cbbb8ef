"""Effective training time (ETTR) at 1k-100k GPUs, modelled from constants measured here.

Two parts, one command:

1. **Validation.** bench/goodput.py's elastic-train arm (two nodes, a node loss and a worker
   crash alternating every ``--failure-every`` seconds), run failure-free and with failures
   (or read back from ``--from-json`` and its ``--keep-logs`` folder). From the failure run's
   logs: each failure's phases (detect, re-form, worker start, restore, first step, and a node
   loss's rejoin pause), the start, the step time. The model (bench/_ettr_model.py) is fed the
   run's own failure times and the median phases, and predicts the run's goodput; the table
   puts it beside the measured one (goal: within 2 points).
2. **Scale.** The same model with a Poisson failure process at Llama 3's per-GPU rate (466
   interruptions in 54 days on 16,384 GPUs), the re-form as ``a + b·nodes``, the restore and
   copy per GB, the snapshot stalls and the product's own intervals (worker.interval), for a
   given step time and state per GPU: ETTR at 1k, 4k, 16k and 100k GPUs and the term that
   dominates each; then beside the published figures. ``--trace CSV`` replays a failure trace
   (``seconds[,kind]`` lines) at ``--trace-gpus`` instead of drawing failures.

    python bench/ettr.py [--duration 150] [--failure-every 20] [--from-json F --from-logs D]
                         [--step-time 6] [--state-gb-per-gpu 0.35] [--reform-per-node 0.0225]
                         [--trace CSV --trace-gpus N] [--skip-validation] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ettr_measure import (
    PHASE_NAMES,
    Measured,
    kind_phases,
    launch_time,
    measure_failure,
    parse_marks,
    predict,
    start_time,
)
from _ettr_model import (
    GPUS_PER_NODE,
    LLAMA3_GPU_MTBF_S,
    TERMS,
    Estimate,
    Job,
    Recovery,
    ettr,
    kind_costs,
    parse_trace,
    replay,
)
from _recovery_parse import parse_events

SCALES = (1_024, 4_096, 16_384, 100_000)
# Constants the validation run cannot measure (a 2-core VM, a tiny state), with their source
PER_GB_SOURCES = {
    "copy_s_per_gb": (0.026, "H200, the just-in-time copy of a 10.7 GB state into its "
                             "reserved, page-locked slot (docs/benchmarks.md, in-memory "
                             "tier by size)"),
    "memory_read_s_per_gb": (0.284, "H200, the read of that copy and its move to the device "
                                    "(same section)"),
    "storage_read_s_per_gb": (0.83, "2-core VM, sharded load 2->3 ranks, cold cache: 0.25 s "
                                    "for 302 MB (docs/benchmarks.md, sharded snapshots)"),
    "memory_stall_s_per_gb": (0.026, "no GPU figure for the periodic sharded copy's stall: "
                                     "the whole copy into a page-locked slot counted as "
                                     "stall (upper bound; H200, same section)"),
    "storage_stall_s_per_gb": (0.022, "2-core VM, SnapshotStore overlapped: 2.0 ms for "
                                      "89.5 MB (docs/benchmarks.md, snapshot stall)"),
}  # fmt: skip
# bench/scale.py, 8-128 agents on one 2-core box: the node-loss round closed at the last
# node, linear fit 0.0225 s per node (docs/benchmarks.md, the fifth round)
REFORM_PER_NODE_S = 0.0225
REFORM_TARGET_S = 0.005  # issue 38's target 2: <= 5 ms per extra node
REPLACE_S = 600.0  # assumed: a spare node joins 10 min after a loss (the job runs one short)
PUBLISHED = (  # reference, its scale (GPUs), what it published, what of ours it is set beside
    ("Llama 3 (Meta, 2024)", 16_384, "> 90 % ETTR over 54 days, 466 interruptions", "ettr"),
    ("ByteRobust (ByteDance, 2025)", 9_600, "97 % ETTR over 3 months", "ettr"),
    ("DLRover (Ant Group)", 1_536, "goodput 95 %; checkpoint stall 0.2 s (H800)", "stall"),
    ("FlashRecovery (2025)", 4_800, "recovery 150 s, flat with scale", "downtime"),
    ("NVIDIA in-process restart", 16_384, "floor ~1.5 s + one step; store barrier 0.5 s at "
                                          "16k ranks", "floor"),
    ("Meta FT-HSDP", 100_000, "recovery stall 10 -> 3 min; ETTR 44 -> 80 %", "downtime"),
)  # fmt: skip


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=150.0, help="goodput run: seconds of steps")
    p.add_argument("--failure-every", type=float, default=20.0, help="goodput run: seconds")
    p.add_argument("--from-json", default="", help="a bench/goodput.py --json of the "
                   "elastic-train arm, instead of running it (with --from-logs)")  # fmt: skip
    p.add_argument("--from-logs", default="", help="that run's --keep-logs folder")
    p.add_argument("--skip-validation", action="store_true", help="the scale tables only, "
                   "from the recovery benchmark's published phases")  # fmt: skip
    p.add_argument("--step-time", type=float, default=6.0, help="seconds (Llama 3 405B: ~6)")
    p.add_argument("--state-gb-per-gpu", type=float, default=0.35,
                   help="GB of state each GPU holds (405B params x 14 B / 16,384)")  # fmt: skip
    p.add_argument("--reform-per-node", type=float, default=REFORM_PER_NODE_S,
                   help="seconds the re-form grows per node (the b of a + b*nodes)")  # fmt: skip
    p.add_argument(
        "--memory-stall-s-per-gb",
        type=float,
        default=PER_GB_SOURCES["memory_stall_s_per_gb"][0],
        help="the periodic in-memory copy's stall per GB (sharded state)",
    )
    p.add_argument(
        "--storage-share",
        type=float,
        default=0.0,
        help="share of failures no node memory survives (resumed from storage)",
    )
    p.add_argument("--trace", default="", help="a failure trace CSV: seconds[,kind] per line")
    p.add_argument("--trace-gpus", type=int, default=16_384)
    p.add_argument("--json", default="", help="write the figures here")
    args = p.parse_args(argv)
    if bool(args.from_json) != bool(args.from_logs):
        p.error("--from-json and --from-logs go together: the run's JSON and its log folder")
    if min(args.step_time, args.duration, args.failure_every) <= 0 or args.state_gb_per_gpu < 0:
        p.error("--step-time, --duration, --failure-every must be > 0; --state-gb-per-gpu >= 0")
    if args.memory_stall_s_per_gb < 0 or not 0 <= args.storage_share <= 1:
        p.error("--memory-stall-s-per-gb must be >= 0 and --storage-share within 0..1")
    return args


# --- validation --------------------------------------------------------------------------
def run_goodput(args: argparse.Namespace, logs: Path) -> dict:
    """bench/goodput.py's elastic-train arm, failure-free then with failures, logs kept."""
    import goodput

    gargs = goodput.parse(["--arms", "elastic-train", "--duration", str(args.duration),
                           "--failure-every", str(args.failure_every),
                           "--keep-logs", str(logs)])  # fmt: skip
    steps = goodput.steps_for(args.duration, goodput.STEP_TIME_S)
    result, raw = goodput.run_arm("elastic-train", gargs, steps)
    return {"settings": {"steps": steps}, "results": [result.to_json()],
            "runs": {"elastic-train": raw}}  # fmt: skip


def failure_logs(logs: Path) -> Path:
    """The kept folder of the run with failures (the newest if several)."""
    found = sorted(logs.glob("elastic-train-*-failures-*"))
    if not found:
        raise SystemExit(f"--from-logs {logs}: no elastic-train-*-failures-* folder in it")
    return found[-1]


def validate(data: dict, logs: Path) -> dict:
    res = data["results"][0]
    run = data["runs"]["elastic-train"]["failures"]
    steps, step_s = int(res["steps"]), float(res["step_time"])
    rows = [tuple(r) for r in run["rows"]]
    folder = failure_logs(logs)
    marks = parse_marks(_text(folder / "markers"))
    ev_a = parse_events(_text(folder / "a.jsonl"))
    ev_all = ev_a + parse_events(_text(folder / "b.jsonl"))
    launched = launch_time(rows, steps, float(run["wall"]))
    times = [at for _, at in run["failures"]] + [float("inf")]
    measured = [
        m for (kind, at), until in zip(run["failures"], times[1:], strict=False)
        if (m := measure_failure(kind=kind, at=at, launched=launched, step_s=step_s, rows=rows,
                                 marks=marks, survivor=ev_a, events=ev_all,
                                 until=until)) is not None
    ]  # fmt: skip
    start_s = start_time(rows, launched, step_s)
    failures = [(kind, at - launched) for kind, at in run["failures"]]
    predicted = predict(steps=steps, step_s=step_s, start_s=start_s, failures=failures,
                        measured=measured)  # fmt: skip
    stalls = [e["stall_ms"] / 1000 for e in ev_all if e.get("event") == "snapshot.saved"]
    return {"steps": steps, "step_s": step_s, "start_s": start_s, "measured": measured,
            "failures": len(failures), "goodput": float(res["goodput"]),
            "predicted": predicted.goodput, "wall": float(run["wall"]),
            "predicted_wall": predicted.wall_s, "stall_s": stalls,
            "steps_lost": res["steps_lost"]}  # fmt: skip


def validation_table(v: dict) -> str:
    ms: list[Measured] = v["measured"]
    lines = ["| failure kind | n | " + " | ".join(PHASE_NAMES)
             + " | rejoin pause | downtime | steps lost |",
             "|---|---:|" + "---:|" * (len(PHASE_NAMES) + 3)]  # fmt: skip
    for kind in sorted({m.kind for m in ms}):
        ph = kind_phases(ms, kind)
        n = sum(m.kind == kind for m in ms)
        cells = [f"{ph[p]:.3f}" for p in PHASE_NAMES]
        total = sum(ph[p] for p in PHASE_NAMES) + ph["join_pause"]
        tail = f" | {ph['join_pause']:.3f} | {total:.3f} | {ph['steps_lost']:g} |"
        lines.append(f"| {kind} | {n} | " + " | ".join(cells) + tail)
    gap = 100 * (v["predicted"] - v["goodput"])
    lines += ["", "| | wall s | goodput |", "|---|---:|---:|",
              f"| measured (bench/goodput.py) | {v['wall']:.1f} | {v['goodput']:.4f} |",
              f"| modelled (its failure times, the medians above) | {v['predicted_wall']:.1f} | "
              f"{v['predicted']:.4f} |",
              f"| modelled - measured | {v['predicted_wall'] - v['wall']:+.1f} | "
              f"{gap:+.2f} points |"]  # fmt: skip
    return "\n".join(lines)


# --- scale -------------------------------------------------------------------------------
def recovery_at_scale(v: dict | None, reform_per_node: float) -> Recovery:
    """The measured phases (the validation run's medians over both kinds, else the recovery
    benchmark's published node loss of 2026-11-27), the re-form as a + b·nodes through the
    measured point, and the per-GB figures of PER_GB_SOURCES."""
    if v is None:  # docs/benchmarks.md, node loss, elastic-train (session), plain
        ph = {"detect": 0.09, "rendezvous": 0.33, "worker_start": 0.12, "restore": 0.03,
              "first_step": 0.01, "join_pause": 0.09, "nodes": 1.0, "start": 10.0}  # fmt: skip
    else:
        ms = v["measured"]
        ph = {p: statistics.median(m.phases[p] for m in ms) for p in PHASE_NAMES}
        pauses = [m.join_pause_s for m in ms if m.join_pause_s is not None]
        ph |= {"join_pause": statistics.median(pauses) if pauses else 0.0,
               "nodes": statistics.median(1.0 if m.kind == "node_loss" else 2.0 for m in ms),
               "start": v["start_s"]}  # fmt: skip
    per_gb = {k: value for k, (value, _) in PER_GB_SOURCES.items() if "stall" not in k}
    return Recovery(detect_s=ph["detect"],
                    reform_base_s=max(0.0, ph["rendezvous"] - reform_per_node * ph["nodes"]),
                    reform_per_node_s=reform_per_node, workers_s=ph["worker_start"],
                    restore_s=ph["restore"], first_step_extra_s=ph["first_step"],
                    join_pause_s=ph["join_pause"], start_s=ph["start"], **per_gb)  # fmt: skip


def job_at(gpus: int, args: argparse.Namespace, **over: object) -> Job:
    fields = {"gpus": gpus, "step_s": args.step_time, "state_gb_per_gpu": args.state_gb_per_gpu,
              "memory_stall_s_per_gb": args.memory_stall_s_per_gb,
              "storage_share": args.storage_share,
              "storage_stall_s_per_gb": PER_GB_SOURCES["storage_stall_s_per_gb"][0],
              "replace_s": REPLACE_S} | over  # fmt: skip
    return Job(**fields)


def scale_table(args: argparse.Namespace, rec: Recovery, scales=SCALES) -> tuple[str, dict]:
    head = (
        "| GPUs | nodes | MTBF h | failures / day | re-form s | downtime / failure s | "
        "ETTR | dominant | " + " | ".join(TERMS) + " |"
    )
    lines = [head, "|" + "---:|" * 6 + "---:|---|" + "---:|" * len(TERMS)]
    out = {}
    for gpus in scales:
        job = job_at(gpus, args)
        est = ettr(job, rec)
        out[gpus] = est
        losses = " | ".join(f"{100 * est.losses[t]:.2f}" for t in TERMS)
        lines.append(f"| {gpus:,} | {job.nodes:,} | {job.mtbf_s / 3600:.2f} | "
                     f"{DAY / job.mtbf_s:.1f} | {rec.reform_s(job.nodes):.1f} | "
                     f"{est.per_failure_s:.1f} | **{est.ettr:.4f}** | {est.dominant} | "
                     f"{losses} |")  # fmt: skip
    return "\n".join(lines), out


DAY = 86_400.0


def published_table(args: argparse.Namespace, rec: Recovery, target: Recovery) -> str:
    """Each reference beside the figure of ours it compares with: measured at two nodes where
    there is one (the validation run), modelled at its scale with the re-form law of today
    and of target 2."""
    lines = ["| reference | GPUs | published (theirs, measured) | elastic-train measured "
             "(2 nodes, 2-core VM) | elastic-train modelled at that scale: re-form today | "
             "with target 2's re-form |", "|---|---:|---|---|---|---|"]  # fmt: skip
    floor = rec.detect_s + rec.reform_s(1) + rec.workers_s + rec.restore_s + rec.first_step_extra_s
    for name, gpus, theirs, what in PUBLISHED:
        job = job_at(gpus, args)
        cells = [_compare(what, ettr(job, r), job, r) for r in (rec, target)]
        measured = {"ettr": "goodput: the validation table", "downtime": f"{floor:.2f} s",
                    "floor": f"{floor:.2f} s (+ one step)",
                    "stall": "2 ms per storage snapshot of 90 MB"}[what]  # fmt: skip
        lines.append(f"| {name} | {gpus:,} | {theirs} | {measured} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def _compare(what: str, est: Estimate, job: Job, rec: Recovery) -> str:
    if what == "ettr":
        return f"ETTR {100 * est.ettr:.1f} % (dominant: {est.dominant})"
    if what == "stall":
        iv = est.intervals
        return (
            f"stall {iv.memory_stall_s:.2f} s per in-memory copy, one every "
            f"{iv.memory_every} steps ({100 * est.losses['stall']:.2f} % of wall); "
            f"ETTR {100 * est.ettr:.1f} %"
        )
    if what == "floor":
        return (
            f"re-form {rec.reform_s(job.nodes):.1f} s at {job.nodes:,} nodes; "
            f"downtime {est.per_failure_s:.1f} s per failure"
        )
    return f"downtime {est.per_failure_s:.1f} s per failure; ETTR {100 * est.ettr:.1f} %"


SENSITIVITY = (  # one input changed at a time, at 16,384 GPUs, with target 2's re-form
    ("as above", {}),
    ("in-memory copy fully overlapped (no stall)", {"memory_stall_s_per_gb": 0.0}),
    ("10 % of failures resumed from storage", {"storage_share": 0.1}),
    ("4 GB of state per GPU", {"state_gb_per_gpu": 4.0}),
    ("1 s steps", {"step_s": 1.0}),
    ("replicated state (a just-in-time copy, nothing redone)", {"sharded": False}),
)


def sensitivity_table(args: argparse.Namespace, rec: Recovery, gpus: int = 16_384) -> str:
    lines = ["| at 16,384 GPUs | ETTR | dominant | its share % | downtime / failure s |",
             "|---|---:|---|---:|---:|"]  # fmt: skip
    for label, over in SENSITIVITY:
        est = ettr(job_at(gpus, args, **over), rec)
        share = 100 * est.losses[est.dominant]
        lines.append(f"| {label} | {est.ettr:.4f} | {est.dominant} | {share:.2f} | "
                     f"{est.per_failure_s:.1f} |")  # fmt: skip
    return "\n".join(lines)


def trace_row(args: argparse.Namespace, rec: Recovery) -> str:
    failures = parse_trace(Path(args.trace).read_text())
    job = job_at(args.trace_gpus, args)
    horizon = max((f.at_s for f in failures), default=0.0) + 3600
    steps = max(1, round(horizon / args.step_time))
    got = replay(steps=steps, step_s=args.step_time, start_s=rec.start_s, failures=failures,
                 costs=kind_costs(job, rec))  # fmt: skip
    return (
        f"trace {args.trace}: {got.failures} failures at {args.trace_gpus:,} GPUs, "
        f"{steps} steps: ETTR {got.goodput:.4f} (wall {got.wall_s / 3600:.1f} h, "
        f"{got.redone_steps:.0f} steps redone)"
    )


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    began = time.monotonic()
    v = None
    if not args.skip_validation:
        if args.from_json:
            data, logs = json.loads(Path(args.from_json).read_text()), Path(args.from_logs)
            v = validate(data, logs)
        else:
            with tempfile.TemporaryDirectory(prefix="bench-ettr-") as tmp:
                v = validate(run_goodput(args, Path(tmp)), Path(tmp))
        print(f"\nValidation: bench/goodput.py's elastic-train arm, {v['steps']} steps of "
              f"{v['step_s']:.4f} s (failure-free), {v['failures']} failures; start "
              f"{v['start_s']:.2f} s; phases in s (medians):\n")  # fmt: skip
        print(validation_table(v))
    rec = recovery_at_scale(v, args.reform_per_node)
    print(
        f"\nScale (modelled): step {args.step_time:g} s, {args.state_gb_per_gpu:g} GB of "
        f"state per GPU, {GPUS_PER_NODE} GPUs per node, Llama 3's failure rate (one per "
        f"{LLAMA3_GPU_MTBF_S / 3600:,.0f} GPU-hours), a 54-day job; loss terms in % of "
        f"wall time; re-form {rec.reform_base_s:.3f} + {rec.reform_per_node_s:g}·nodes s\n"
    )
    table, estimates = scale_table(args, rec)
    print(table)
    target = Recovery(**{**rec.__dict__, "reform_per_node_s": REFORM_TARGET_S})
    print(f"\nThe same with the re-form at target 2's {REFORM_TARGET_S * 1000:g} ms per node:\n")
    target_table, target_estimates = scale_table(args, target)
    print(target_table)
    print("\nOne input changed at a time (target 2's re-form):\n")
    print(sensitivity_table(args, target))
    print("\nBeside the published figures (theirs measured, ours modelled):\n")
    print(published_table(args, rec, target))
    if args.trace:
        print("\n" + trace_row(args, rec))
    print(
        "\nPer-GB constants: "
        + "; ".join(f"{k} {val:g} ({why})" for k, (val, why) in PER_GB_SOURCES.items())
    )
    print(f"\n({time.monotonic() - began:.0f} s in all)")
    if args.json:
        Path(args.json).write_text(json.dumps(_json(v, rec, estimates, target_estimates), indent=1))
    return 0


def _json(v: dict | None, rec: Recovery, est: dict[int, Estimate], tgt: dict) -> dict:
    def one(e: Estimate) -> dict:
        return {"ettr": e.ettr, "losses": e.losses, "dominant": e.dominant,
                "per_failure_s": e.per_failure_s, "failures": e.failures,
                "memory_every": e.intervals.memory_every,
                "storage_every": e.intervals.storage_every}  # fmt: skip

    val = None
    if v is not None:
        val = {k: v[k] for k in ("steps", "step_s", "start_s", "failures", "goodput",
                                 "predicted", "wall", "predicted_wall", "steps_lost")}  # fmt: skip
        val["per_failure"] = [m.__dict__ for m in v["measured"]]
        val["stall_s"] = v["stall_s"]
    return {"validation": val, "recovery": rec.__dict__,
            "scale": {g: one(e) for g, e in est.items()},
            "scale_target_reform": {g: one(e) for g, e in tgt.items()}}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
