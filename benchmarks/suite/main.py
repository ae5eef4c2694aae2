"""The whole suite: local, resume and remote, then the table, the chart and the JSON of the run."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Any

from . import data
from .runner import Config, run_rounds, spec_for

RESULTS = Path(__file__).resolve().parents[1] / "results"
PF = 16  # guideloom's prefetch in the prefetching configurations

PEER_LABELS = {
    "torch": "torch DataLoader (__getitem__)",
    "torch-getitems": "torch DataLoader (batched __getitems__)",
    "torchdata": "torchdata StatefulDataLoader (__getitem__)",
    "torchdata-getitems": "torchdata StatefulDataLoader (__getitems__)",
    "streaming": "MosaicML Streaming StreamingDataset (MDS)",
    "litdata": "LitData StreamingDataset (TokensLoader)",
    "grain": "Grain DataLoader (memmap source)",
}

RESUME_HOW = {
    "bare": "computes the order at the offset",
    "guideloom": "no replay: the Feistel permutation is evaluated at the offset",
    "torch": "no state of its own; resumed with a sampler that slices randperm(n) (O(epoch))",
    "torchdata": "replays the sampler: regenerates randperm(n), then next() once per sample to skip",
    "streaming": "no data replay; rebuilds the epoch's shuffle (O(epoch)) and skips sample_in_epoch",
    "litdata": "no data replay; maps the sample count to a chunk and an offset",
    "grain": "no replay: stateless IndexSampler, the state is the last index seen",
}


def machine() -> dict[str, Any]:
    import numpy
    import psutil
    import torch

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {"python": platform.python_version(), "numpy": numpy.__version__, "torch": torch.__version__}
    for mod, dist in (
        ("torchdata", "torchdata"),
        ("streaming", "mosaicml-streaming"),
        ("litdata", "litdata"),
        ("grain", "grain"),
    ):
        try:
            from importlib.metadata import version

            versions[mod] = version(dist)
        except Exception:
            versions[mod] = "not installed"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": f"{platform.system()} {platform.release()}",
        "load_at_start": os.getloadavg()[0],
        "versions": versions,
    }


def local_configs(peers: list[str]) -> list[Config]:
    cfgs = [
        Config("bare", "bare loop: memmap gather + to int64 (the limit)", "bare", "local"),
        Config("gl-0-pf0", "guideloom, prefetch=0 (default)", "guideloom", "local", 0, {"prefetch": 0}),
        Config(f"gl-0-pf{PF}", f"guideloom, prefetch={PF}", "guideloom", "local", 0, {"prefetch": PF}),
    ]
    cfgs += [Config(f"{p}-0", PEER_LABELS[p], p, "local", 0) for p in peers]
    cfgs += [
        Config(
            "gl-2-pf0",
            "guideloom, prefetch=0 (default), thread workers",
            "guideloom",
            "local",
            2,
            {"prefetch": 0},
        ),
        Config(
            f"gl-2-pf{PF}",
            f"guideloom, prefetch={PF}, thread workers",
            "guideloom",
            "local",
            2,
            {"prefetch": PF},
        ),
    ]
    cfgs += [Config(f"{p}-2", PEER_LABELS[p], p, "local", 2) for p in peers]
    return cfgs


def resume_configs(peers: list[str]) -> list[Config]:
    cfgs = [Config("gl-r", "guideloom, prefetch=0", "guideloom", "resume", 0, {"prefetch": 0})]
    return cfgs + [
        Config(f"{p}-r", PEER_LABELS[p], p, "resume", 0) for p in peers if p != "torchdata-getitems"
    ]


def run(quick: bool, rounds: int | None, parts: set[str], peers: list[str], tokens: int) -> dict[str, Any]:
    t_start = time.perf_counter()
    rounds = rounds or (1 if quick else 3)
    print(f"data ({tokens:,} uint16 tokens, cached under {data.data_root()}) ...", flush=True)
    d = data.ensure_all(tokens, peers=bool({"streaming", "litdata"} & set(peers)))
    out: dict[str, Any] = {
        "machine": machine(),
        "command": "python -m benchmarks suite" + (" --quick" if quick else ""),
        "rounds": rounds,
        "tokens": tokens,
        # CPU counts each process's reaped children (workers that exit inside the window)
        "cpu_counts_exited": True,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    # An epoch is 3,051 batches: warm-up and window stay inside it (no loader restarts in the window).
    timing = {
        "warmup": 50,
        "warmup_s": 0.0,
        "batches": 2500,
        "min_batches": 30,
        "max_s": 1.0 if quick else 2.5,
    }
    out["timing"] = timing
    if "local" in parts:
        cfgs = local_configs(peers)
        print(f"local: {len(cfgs)} configurations x {rounds} rounds", flush=True)
        specs = {c.key: [spec_for(c, d, timing)] for c in cfgs}
        res = run_rounds(cfgs, specs, rounds, "bare")
        out["local"] = [
            {"key": c.key, "label": c.label, "peer": c.peer, "nw": c.nw, **res[f"{c.key}#0"]} for c in cfgs
        ]
    if "resume" in parts:
        cfgs = resume_configs(peers)
        points = [1_000, 1_000_000]
        print(f"resume: {len(cfgs)} loaders x {len(points)} points x {rounds} rounds", flush=True)
        specs = {c.key: [spec_for(c, d, timing, resume=p) for p in points] for c in cfgs}
        res = run_rounds(cfgs, specs, rounds, None)
        out["resume"] = [
            {
                "key": c.key,
                "label": c.label,
                "peer": c.peer,
                "how": RESUME_HOW.get(c.peer.split("-")[0], ""),
                **{f"ttfb_at_{p}": res[f"{c.key}#{i}"].get("ttfb_s") for i, p in enumerate(points)},
                **{f"error_at_{p}": res[f"{c.key}#{i}"].get("error") for i, p in enumerate(points)},
                "peak_rss_mib": res[f"{c.key}#1"].get("peak_rss_mib"),
            }
            for c in cfgs
        ]
    if "remote" in parts:
        remote = run_remote(d, quick, max(1, rounds - 1) if not quick else 1, peers)
        out["remote"] = [r for r in remote if r.get("rtt") != "moto"]
        out["moto"] = [r for r in remote if r.get("rtt") == "moto"]  # a table of its own below
        for r in out["moto"]:
            print(
                f"moto S3: {r['label']} [nw={r['nw']}]: {r.get('samples_per_s', 0):,.0f} samples/s, "
                f"first batch {r.get('ttfb_s', float('nan')):.3f} s"
                + (f" ERROR {r['error']}" if "error" in r else ""),
                flush=True,
            )
    out["wall_s"] = time.perf_counter() - t_start
    return out


def _remote_config(peer: str, nw: int, pf: int, key: str, extra: dict[str, Any]) -> Config:
    own = {
        "guideloom": f"guideloom, prefetch={pf}",
        "guideloom-auto": f'guideloom, shuffle_block_size="auto", prefetch={pf}',
        "guideloom-cache": "guideloom, cache_dir (copied in the background, then local)",
    }
    label = own.get(peer) or PEER_LABELS[peer]
    kind = "guideloom" if peer.startswith("guideloom") else peer
    extra = {
        "prefetch": pf,
        "gl_cache": peer == "guideloom-cache",
        "gl_block": "auto" if peer == "guideloom-auto" else None,
        **extra,
    }
    return Config(key, label, kind, "remote", nw, extra)


def run_remote(
    d: data.Data, quick: bool, rounds: int, peers: list[str], with_moto: bool = True
) -> list[dict[str, Any]]:
    from .remote import moto_server, peer_spec, servers

    rtts = (0.0, 0.020)
    # Steady state over object storage: 2 s of warm-up (the streaming peers fill their caches,
    # guideloom's cache_dir copy completes), then up to 4 s or 6,000 batches, going on into the
    # next epoch (a new loader, as a training run's next epoch) when one ends.
    timing = {
        "warmup": 5,
        "warmup_s": 1.0 if quick else 2.0,
        "batches": 6000,
        "min_batches": 20,
        "max_s": 2.0 if quick else 4.0,
        "multi_epoch": True,
    }
    ceilings = [(1, 256), (8, 128)]
    results: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        urls = stack.enter_context(servers(d, rtts))
        moto = stack.enter_context(moto_server(d, peers)) if with_moto else None
        cfgs: list[Config] = []
        specs: dict[str, list[dict[str, Any]]] = {}
        caches: list[str] = []
        for rtt, base in urls.items():
            tag = f"{rtt * 1000:.0f}ms"
            for per_call, k in ceilings:
                key = f"ceil-{per_call}x{k}-{tag}"
                name = "get_range_async" if per_call == 1 else f"get_ranges_async x{per_call}"
                cfgs.append(
                    Config(
                        key, f"ceiling: {name}, {k} in flight", "remote-ceiling", "remote", 0, {"rtt": rtt}
                    )
                )
                ps = peer_spec("ceiling", base, "")
                caches.append(ps["cache"])
                specs[key] = [
                    {
                        **spec_for(cfgs[-1], d, timing),
                        **ps,
                        "num_samples": d.samples,
                        "concurrency": k,
                        "per_call": per_call,
                        "batches": 400 if quick else 800,
                    }
                ]
            for peer, nw, pf in [
                ("guideloom", 0, PF),
                ("guideloom-auto", 0, PF),
                ("guideloom", 0, 0),
                ("guideloom-cache", 0, 0),
                ("streaming", 0, 0),
                ("litdata", 0, 0),
                ("streaming", 2, 0),
                ("litdata", 2, 0),
            ]:
                if not peer.startswith("guideloom") and peer not in peers:
                    continue
                key = f"{peer}-{nw}-pf{pf}-{tag}"
                cfgs.append(_remote_config(peer, nw, pf, key, {"rtt": rtt}))
                ps = peer_spec(peer, base, "")
                caches.append(ps["cache"])
                specs[key] = [{**spec_for(cfgs[-1], d, timing), **ps}]
        if moto is not None:  # moto S3 on loopback: guideloom (32 MiB shards) beside LitData
            for peer, nw, pf in [
                ("guideloom", 0, PF),
                ("guideloom-auto", 0, PF),
                ("litdata", 0, 0),
                ("litdata", 2, 0),
            ]:
                if not peer.startswith("guideloom") and peer not in peers:
                    continue
                key = f"{peer}-{nw}-pf{pf}-moto"
                cfgs.append(_remote_config(peer, nw, pf, key, {"rtt": "moto"}))
                ps = peer_spec(peer, moto, "")
                ps["gl"] = "s3://bucket/gl"  # the AWS_* variables of peer_spec point at moto
                caches.append(ps["cache"])
                specs[key] = [{**spec_for(cfgs[-1], d, timing), **ps}]
        print(
            f"remote: {len(cfgs)} configurations x {rounds} rounds (nginx on 127.0.0.1; +0 and +20 ms)",
            flush=True,
        )
        try:
            res = run_rounds(cfgs, specs, rounds, None)
        finally:
            for c in caches:
                shutil.rmtree(c, ignore_errors=True)
        for c in cfgs:
            results.append(
                {"key": c.key, "label": c.label, "peer": c.peer, "nw": c.nw, **c.extra, **res[f"{c.key}#0"]}
            )
    return results


def save(out: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "latest.json").write_text(json.dumps(out, indent=1, default=str) + "\n")


__all__ = ["run", "save"]
