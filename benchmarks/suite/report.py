"""The markdown table and the PNG chart of a run (``benchmarks/results/``), and the docs'
Benchmarks page.

``docs/benchmarks.md`` is generated, never edited: the method and the suite's latest tables
(the command table from the entry point, :func:`markdown`), then each benchmark's section from
``figures.md`` (what it measures, the command that reproduces it, its latest table, what the
figures mean).
:func:`check_figures` keeps that file to the latest figures: how a figure changed belongs in
``docs/changelog.md``.
"""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path
from typing import Any

SEQ = 2048


def _f(x: Any, fmt: str = ",.0f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, fmt)


def _md(text: Any) -> str:
    """``text`` for a Markdown table cell: ``__getitem__`` stays a name, not bold ``getitem``."""
    return str(text).replace("__", "\\_\\_")


def _row(*cells: Any) -> str:
    return "| " + " | ".join(_md(c) for c in cells) + " |"


def _best(rows: list[dict[str, Any]], pred: Any, metric: str = "samples_per_s") -> dict[str, Any] | None:
    cands = [r for r in rows if pred(r) and r.get(metric) is not None]
    return max(cands, key=lambda r: r[metric]) if cands else None


def ratio(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """``a`` against ``b``, the one metric every comparison of the page is judged on: the median of
    their samples/s ratios round by round where both rows carry their rounds; else the ratio of
    their "x bare loop" figures (each the median of the rounds' ratios to the same bare loop, the
    column the local table shows); else, for the remote rows, whose rounds have no shared baseline,
    the ratio of their medians (the "x ceiling" column)."""
    ra, rb = a.get("round_samples_per_s"), b.get("round_samples_per_s")
    if ra and rb and len(ra) == len(rb):
        per_round = [x / y for x, y in zip(ra, rb, strict=True) if x and y]
        if per_round:
            return statistics.median(per_round)
    if a.get("x_limit") and b.get("x_limit"):
        return float(a["x_limit"]) / float(b["x_limit"])
    if a.get("samples_per_s") and b.get("samples_per_s"):
        return float(a["samples_per_s"]) / float(b["samples_per_s"])
    return None


def _how(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Which figures :func:`ratio` compared, for the Targets table."""
    ra, rb = a.get("round_samples_per_s"), b.get("round_samples_per_s")
    if ra and rb and len(ra) == len(rb):
        return "median of the rounds' ratios"
    if a.get("x_limit") and b.get("x_limit"):
        return f"x bare loop {a['x_limit']:.3g} against {b['x_limit']:.3g}"
    return "medians of samples/s"


def _weakest(gl: dict[str, Any], peers: list[dict[str, Any]]) -> tuple[dict[str, Any], float] | None:
    """The peer ``gl`` is least ahead of, by :func:`ratio`, and that ratio."""
    scored = [(p, x) for p in peers if (x := ratio(gl, p)) is not None]
    return min(scored, key=lambda px: px[1]) if scored else None


def targets(out: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) for each of guideloom's performance targets that this run measured,
    each judged by :func:`ratio`, the metric of the tables beside them."""
    res: list[tuple[str, str, bool | None]] = []
    local = [r for r in out.get("local", []) if "error" not in r]
    if local:
        for nw in (0, 2):
            gl = _best(local, lambda r, nw=nw: r["peer"] == "guideloom" and r["nw"] == nw, "x_limit")
            peers = [r for r in local if r["peer"] not in ("guideloom", "bare") and r["nw"] == nw]
            if gl and nw == 0:
                x = gl["x_limit"]
                res.append(
                    ("local nw=0: guideloom >= 0.8x the bare loop", f"{x:.2f}x ({gl['label']})", x >= 0.8)
                )
            weakest = _weakest(gl, peers) if gl else None
            if gl and weakest:
                peer, x = weakest
                res.append(
                    (
                        f"local nw={nw}: ahead of every peer",
                        f"{x:.2f}x the closest peer, {peer['label']} ({_how(gl, peer)}; {gl['label']})",
                        x > 1,
                    )
                )
            glm = [r for r in local if r["peer"] == "guideloom" and r["nw"] == nw and r.get("peak_rss_mib")]
            rss = [r for r in peers if r.get("peak_rss_mib")]
            if glm and rss:
                lo = min(r["peak_rss_mib"] for r in glm)
                lowest = min(rss, key=lambda r: r["peak_rss_mib"])
                res.append(
                    (
                        f"peak RSS nw={nw}: below every peer",
                        f"{lo:.0f} MiB vs {lowest['peak_rss_mib']:.0f} MiB ({lowest['label']})",
                        lo < lowest["peak_rss_mib"],
                    )
                )
    for r in out.get("resume", []):
        if r["peer"] == "guideloom" and r.get("ttfb_at_1000") is not None and r.get("ttfb_at_1000000"):
            a, b = r["ttfb_at_1000"], r["ttfb_at_1000000"]
            res.append(
                ("resume: same at batch 1,000 and 1,000,000", f"{a:.3f} s / {b:.3f} s", b < 1.5 * a + 0.01)
            )
            res.append(("resume: below 0.1 s locally", f"{max(a, b):.3f} s", max(a, b) < 0.1))
    remote = [r for r in out.get("remote", []) if r.get("rtt") == 0.02 and "error" not in r]
    if remote:
        gls = [r for r in remote if r["peer"] == "guideloom"]
        streaming = [r for r in remote if r["peer"] in ("streaming", "litdata")]
        ceilings = [r for r in remote if r["peer"] == "remote-ceiling"]
        best = _strongest(gls, streaming)
        ranged = _strongest([r for r in gls if not r.get("gl_cache")], streaming)
        if best:
            gl, peer, x = best
            res.append(
                (
                    "remote 20 ms: >= 5x the best streaming peer",
                    f"{x:.2f}x ({gl['label']} vs {peer['label']}, nw={peer['nw']})",
                    x >= 5,
                )
            )
        if ranged:
            gl, peer, x = ranged
            res.append(
                (
                    "(for reference) remote 20 ms, range reads only: vs the best streaming peer",
                    f"{x:.2f}x ({gl['label']} vs {peer['label']}, nw={peer['nw']})",
                    None,
                )
            )
        ceil = _strongest([r for r in gls if not r.get("gl_cache")], ceilings)
        if ceil:
            gl, c, x = ceil
            res.append(
                (
                    "remote 20 ms: >= 0.8x the range-read ceiling",
                    f"{x:.2f}x ({gl['label']} vs {c['label']})",
                    x >= 0.8,
                )
            )
    return res


def _strongest(
    gls: list[dict[str, Any]], peers: list[dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any], float] | None:
    """guideloom's configuration that is furthest ahead of its closest peer, by :func:`ratio`:
    (that configuration, that peer, the ratio)."""
    best: tuple[dict[str, Any], dict[str, Any], float] | None = None
    for gl in gls:
        weakest = _weakest(gl, peers)
        if weakest and (best is None or weakest[1] > best[2]):
            best = (gl, *weakest)
    return best


LOCAL_COLS = (
    "loader",
    "num_workers",
    "samples/s",
    "tokens/s",
    "x bare loop",
    "first batch (s)",
    "peak RSS (MiB)",
    "of which anonymous (MiB)",
    "CPU s / 1k batches",
)
REMOTE_COLS = (
    "added RTT",
    "loader",
    "num_workers",
    "samples/s",
    "x ceiling",
    "first batch (s)",
    "peak RSS (MiB)",
    "CPU s / 1k batches",
)


def markdown(out: dict[str, Any], *, dated: bool = True) -> str:
    """The run's tables; ``dated=False`` leaves the run's date out (the docs page speaks of the
    software and the machine, not of when)."""
    m = out["machine"]
    v = m["versions"]
    when = f" on {out['date']}" if dated else ""
    lines = [
        "# guideloom benchmark results",
        "",
        f"`{out['command']}`{when}, {out['rounds']} alternating rounds, medians; "
        f"suite wall time {out.get('wall_s', 0) / 60:.1f} min.",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB RAM, {m['os']} "
        f"(load average {m['load_at_start']:.2f} at start; shared with other work). "
        + ", ".join(f"{k} {x}" for k, x in v.items())
        + ".",
        "",
        f"Workload: a uint16 token stream of {out['tokens']:,} tokens, sequence_length=2048, "
        "local_batch_size=16, shuffle on (seed 0), collate to an int64 (16, 2048) tensor, one rank. "
        "Peak RSS is the sum over the process tree (main process and workers), sampled every 20 ms "
        "(its anonymous part leaves out mapped file pages: the page cache of a memory-mapped dataset); "
        "CPU is user+system seconds of the tree per 1,000 steady-state batches "
        + (
            "(worker processes that exit inside the window included)."
            if out.get("cpu_counts_exited")
            else "(this run left out worker processes that exit inside the window: where a loader's "
            "workers end with each epoch, its CPU reads low)."
        ),
        "",
    ]
    unmeasured: list[str] = []  # rows whose CPU figure is no measurement
    if out.get("local"):
        lines += [
            "## Local disk (page cache warm)",
            "",
            _row(*LOCAL_COLS),
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in out["local"]:
            if "error" in r:
                lines.append(_row(r["label"], r["nw"], f"failed: {r['error'][:80]}", "", "", "", "", "", ""))
                continue
            lines.append(
                _row(
                    r["label"],
                    r["nw"],
                    _f(r.get("samples_per_s")),
                    _f(r.get("tokens_per_s"), ",.3g"),
                    _f(r.get("x_limit"), ".2f"),
                    _f(r.get("ttfb_s"), ".3f"),
                    _f(r.get("peak_rss_mib")),
                    _f(r.get("peak_anon_rss_mib")),
                    _cpu(r, unmeasured),
                )
            )
        lines.append("")
    if out.get("resume"):
        lines += [
            "## Time to first batch after resuming (num_workers=0)",
            "",
            "A virtual epoch of 2**24 samples (64 GiB: a sparse file for the raw and guideloom layouts, "
            "the first MDS shard / LitData chunk listed again and again for the others); "
            "the time runs from building the loader and loading its state to the first batch in hand.",
            "",
            _row(
                "loader",
                "resume at batch 1,000 (s)",
                "at batch 1,000,000 (s)",
                "peak RSS (MiB)",
                "how it resumes",
            ),
            "| --- | ---: | ---: | ---: | --- |",
        ]
        for r in out["resume"]:
            a = _f(r.get("ttfb_at_1000"), ".3f") if not r.get("error_at_1000") else "failed"
            b = _f(r.get("ttfb_at_1000000"), ".3f") if not r.get("error_at_1000000") else "failed"
            lines.append(_row(r["label"], a, b, _f(r.get("peak_rss_mib")), r["how"]))
        lines.append("")
    if out.get("remote"):
        lines += [
            "## Over HTTP (nginx on 127.0.0.1), without and with 20 ms added round trip",
            "",
            _row(*REMOTE_COLS),
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for rtt in sorted({r["rtt"] for r in out["remote"]}):
            rows = [r for r in out["remote"] if r["rtt"] == rtt]
            ceil = _best(rows, lambda r: r["peer"] == "remote-ceiling")
            for r in rows:
                if "error" in r:
                    lines.append(
                        _row(
                            f"{rtt * 1000:.0f} ms",
                            r["label"],
                            r["nw"],
                            f"failed: {r['error'][:80]}",
                            "",
                            "",
                            "",
                            "",
                        )
                    )
                    continue
                x = ratio(r, ceil) if ceil and r.get("samples_per_s") else None
                lines.append(
                    _row(
                        f"{rtt * 1000:.0f} ms",
                        r["label"],
                        r["nw"],
                        _f(r.get("samples_per_s")),
                        _f(x, ".2f"),
                        _f(r.get("ttfb_s"), ".3f"),
                        _f(r.get("peak_rss_mib")),
                        _cpu(r, unmeasured),
                    )
                )
        lines.append("")
    if unmeasured:
        lines += [
            f'CPU "-" ({"; ".join(dict.fromkeys(unmeasured))}): not measured. The figure came out '
            "below zero, which no CPU time is: the window's sum over the process tree lost the seconds of "
            "worker processes that ended within it (these workers end with every epoch). The suite's "
            "child counts each process's reaped children as well, so a fresh run measures them.",
            "",
        ]
    ts = targets(out)
    if ts:
        lines += ["## Targets", "", "| target | measured | met |", "| --- | --- | --- |"]
        lines += [_row(t, m_, "-" if ok is None else "yes" if ok else "no") for t, m_, ok in ts]
        lines.append("")
    return "\n".join(lines)


def _cpu(r: dict[str, Any], unmeasured: list[str]) -> str:
    """The row's CPU seconds per 1,000 batches; "-" (its label added to ``unmeasured``, for the
    footnote) where the figure is below zero, which no measurement of CPU time can be."""
    cpu = r.get("cpu_s_per_1k")
    if cpu is not None and cpu < 0:
        rtt = f", +{r['rtt'] * 1000:.0f} ms" if isinstance(r.get("rtt"), float) else ""
        unmeasured.append(f"{r['label']}, num_workers={r['nw']}{rtt}")
        return "-"
    return _f(cpu, ".2f")


def chart(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in ("local", "resume", "remote") if out.get(p)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 4.2 * len(panels)), squeeze=False)
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        rows = out[panel]
        if panel == "resume":
            names = [r["label"] for r in rows]
            a = [r.get("ttfb_at_1000") or 0 for r in rows]
            b = [r.get("ttfb_at_1000000") or 0 for r in rows]
            y = range(len(rows))
            ax.barh([i + 0.2 for i in y], a, 0.4, label="resume at batch 1,000")
            ax.barh([i - 0.2 for i in y], b, 0.4, label="resume at batch 1,000,000")
            ax.set_xscale("log")
            ax.set_xlabel("time to first batch after resume, s (log)")
            ax.set_yticks(list(y), names, fontsize=8)
            ax.legend(fontsize=8)
            ax.set_title("Resume (num_workers=0, virtual epoch of 2**24 samples)")
            continue
        if panel == "local":
            names = [f"{r['label']} [nw={r['nw']}]" for r in rows]
            title = "Local: samples/s (int64 (16, 2048) batches), medians"
            colors = [
                "black" if r["peer"] == "bare" else "tab:green" if r["peer"] == "guideloom" else "tab:gray"
                for r in rows
            ]
        else:
            names = [f"{r['label']} [nw={r['nw']}, +{r['rtt'] * 1000:.0f} ms]" for r in rows]
            title = "HTTP via nginx on 127.0.0.1 (+0 ms and +20 ms round trip): samples/s, medians"
            colors = [
                "black"
                if r["peer"] == "remote-ceiling"
                else "tab:green"
                if r["peer"] == "guideloom"
                else "tab:gray"
                for r in rows
            ]
        vals = [r.get("samples_per_s") or 0 for r in rows]
        y = list(range(len(rows)))[::-1]
        ax.barh(y, vals, color=colors)
        ax.set_yticks(y, names, fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("samples/s (log)")
        ax.set_title(title)
        for yi, v in zip(y, vals, strict=True):
            if v:
                ax.text(v, yi, f" {v:,.0f}", va="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_INTRO = """\
# Benchmarks

guideloom against the loaders people use today, on the same data in the same run:
`torch.utils.data.DataLoader` (with a per-row `__getitem__`, and with a batched `__getitems__`),
torchdata's `StatefulDataLoader`, MosaicML Streaming's `StreamingDataset`, LitData's
`StreamingDataset` and Grain, and against the machine's own limit (a bare loop with no loader).

{commands}

The page is generated by `python -m benchmarks report` (and `suite`) from
`benchmarks/results/latest.json` and `benchmarks/suite/figures.md`; how each figure changed
from version to version is in the [changelog](changelog.md).

How it measures: every configuration runs in a fresh interpreter (torch imported before the clock
starts), in alternating rounds, and the figures are medians over the rounds; "x bare loop" is the
ratio to the bare loop *of the same round*. Every comparison with a peer, and every target, is judged
on ratios of that kind: guideloom's samples/s over the peer's in each round, their median (where a
run kept no rounds, guideloom's "x bare loop" over the peer's), never on two medians of samples/s,
which may come from different rounds. Each peer reads its own native format written from the
same tokens: the raw uint16 memmap (torch, torchdata, Grain; guideloom's own data file is that
file), MDS shards of 64 MiB (Streaming), `litdata.optimize(..., item_loader=TokensLoader())`
chunks of 32 MiB (LitData). Streaming and LitData shuffle within shards/chunks (their design);
guideloom, torch, torchdata and Grain shuffle globally, one 4 KiB row at a time. Over HTTP,
Streaming and LitData have no plain-HTTP source, so they read the same nginx as an S3 endpoint
(path-style GETs and ranged GETs are plain HTTP requests); guideloom reads `http://` directly,
with range requests only, and with `cache_dir` (the dataset copied to a local folder in the
background, as Streaming and LitData copy their shards). The remote figures are a steady state:
2 s of warm-up, then up to 4 s running epochs of the same loader one after another.
The source is in `benchmarks/suite/`; the latest raw figures are in `benchmarks/results/latest.json`.

![benchmark chart](../benchmarks/results/results.png)

"""


_COMMAND_LINE = re.compile(r"^\s+(python -m benchmarks .+?)\s+# (.+)$")


def commands_table() -> str:
    """Every benchmark command and what it runs, as a Markdown table, from the entry point's
    docstring (``benchmarks/__main__.py``: the one list of commands)."""
    from .. import __main__ as entry

    rows = [m.groups() for m in map(_COMMAND_LINE.match, (entry.__doc__ or "").splitlines()) if m]
    return "| command | what it runs |\n|---|---|\n" + "".join(f"| `{c}` | {what} |\n" for c, what in rows)


#: What a page of latest figures does not say: a figure's history ("before", "previous", "now"),
#: the circumstances of one session, a date. Matched case-insensitively, outside code spans.
HISTORY = re.compile(
    r"\b(before the change|previous(ly)?|no longer|now|after merging|another session|this session|"
    r"just before|run [12]\b|first version|the same day)\b|\| before\b|\d{4}-\d{2}-\d{2}",
    re.IGNORECASE,
)
_COMMAND = re.compile(r"`python -m benchmarks [a-z-]+")


def check_figures(text: str, source: str = "benchmarks/suite/figures.md") -> None:
    """Refuse a figures file that is not the latest figures alone: every ``##`` section names the
    command that reproduces it, and no line tells a figure's history (that goes to
    ``docs/changelog.md``). Raises ``ValueError`` naming the line and the fix."""
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    if not sections:
        raise ValueError(f"{source}: no '## ' section; each benchmark is one section")
    for section in sections:
        title = section.splitlines()[0]
        if title != "What the figures mean" and not _COMMAND.search(section):
            raise ValueError(
                f"{source}: section {title!r} names no `python -m benchmarks ...` command: "
                "give the command that reproduces its figures"
            )
    for number, line in enumerate(text.splitlines(), 1):
        hit = HISTORY.search(re.sub(r"`[^`]*`", "", line))
        if hit:
            raise ValueError(
                f"{source}:{number}: {hit.group(0)!r} tells a figure's history; keep the latest "
                "figures here and move how they changed to docs/changelog.md"
            )


def docs_page(out: dict[str, Any], figures: str) -> str:
    """``docs/benchmarks.md``: the method, the suite's latest tables (undated), then ``figures``
    (checked by :func:`check_figures`)."""
    check_figures(figures)
    body = markdown(out, dated=False).split("\n", 1)[1].lstrip()  # drop the results page's title
    return (
        _INTRO.replace("{commands}\n", commands_table())
        + "## Latest figures\n\n"
        + body.replace("\n## ", "\n### ")
        + "\n"
        + figures
    )
