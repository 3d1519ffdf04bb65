"""The tables BENCHMARKS.md quotes, printed from saved results."""

from __future__ import annotations

from harness.common import category_order, gm_cell, gmean, table


def _groups(results: list[dict]) -> list[tuple[str, list[dict]]]:
    cats = category_order(r["category"] for r in results)
    return [(c, [r for r in results if r["category"] == c]) for c in cats] + [("all", results)]


def _vals(group: list[dict], label: str, name: str, key: str) -> list[float]:
    return [r["tables"][label][name][key] for r in group if name in r["tables"][label]]


def best_fixed(group: list[dict], label: str, prefix: str) -> tuple[str | None, float]:
    """The fixed draft length (`prefix N`) with the best geometric-mean speedup over the group."""
    names = {n for r in group for n in r["tables"][label] if n.startswith(prefix + " ") and n.split()[-1].isdigit()}
    scored = [(gmean(_vals(group, label, n, "speedup")), n) for n in names]
    return (max(scored)[1], max(scored)[0]) if scored else (None, float("nan"))


def replay_tables(results: list[dict], tables, title: str) -> None:
    natives = sorted({n for r in results for n in r["tables"][tables[0].label] if n.startswith("native ")})
    has_draft = any("draft auto" in r["tables"][tables[0].label] for r in results)
    for costs in tables:
        label = costs.label
        names = ["lookup auto", "lookup 16", "memory auto", *(["draft auto", "hybrid auto"] if has_draft else [])]
        head = ["category", "n", *names, "best native n-gram", *(["best draft N"] if has_draft else []), "oracle lookup",
                *(["oracle draft"] if has_draft else [])]
        rows = []
        for cat, group in _groups(results):
            cells = [cat, len(group)]
            for name in names:
                sp, tpp = _vals(group, label, name, "speedup"), _vals(group, label, name, "tpp")
                cells.append(f"{gm_cell(sp, suffix='x')} / {gmean(tpp):.2f}")
            nat = [max(r["tables"][label][n]["speedup"] for n in natives) for r in group]
            nat_tpp = [max(r["tables"][label][n]["tpp"] for n in natives) for r in group]
            cells.append(f"{gmean(nat):.2f}x / {gmean(nat_tpp):.2f}")
            if has_draft:
                name, value = best_fixed(group, label, "draft")
                cells.append(f"{name.split()[-1]}: {value:.2f}x / {gmean(_vals(group, label, name, 'tpp')):.2f}" if name else "-")
            for name in ["oracle lookup", *(["oracle draft"] if has_draft else [])]:
                cells.append(f"{gmean(_vals(group, label, name, 'speedup')):.2f}x / {gmean(_vals(group, label, name, 'tpp')):.2f}")
            rows.append(cells)
        table(head, rows, f"\n## {title}: modelled on {label} (T(1) {costs.table(1) * 1e3:.1f} ms, T(4)/T(1) "
              f"{costs.table(4) / costs.table(1):.2f}, T(16)/T(1) {costs.table(16) / costs.table(1):.2f}, draft token "
              f"{costs.t_draft / costs.table(1):.2f} T(1)): speedup over plain decoding, geometric mean [min-max] / tokens per pass")
        drafted = {n: sum(r["tables"][label][n]["drafted"] for r in results if n in r["tables"][label]) for n in names + natives}
        refused = {n: sum(r["tables"][label][n]["refused"] for r in results if n in r["tables"][label]) for n in names + natives}
        print("refused / drafted tokens, all texts: " + ", ".join(f"{n} {refused[n]}/{drafted[n]}" for n in drafted))
    goals(results, tables, natives, has_draft, title)


def goals(results: list[dict], tables, natives: list[str], has_draft: bool, title: str) -> None:
    """BENCHMARKS.md's goals per category: the defaults against plain decoding on this machine's
    table (never below 0.98: the worst text in brackets), auto against the best fixed N under
    the GPU-like table (at least 0.95), lookup's tokens per pass against the best native n-gram
    drafter's."""
    cpu, gpu = tables[0].label, tables[-1].label
    defaults = ["lookup auto", *(["draft auto", "hybrid auto"] if has_draft else [])]
    head = ["category", *[f"{d} vs plain, {cpu}" for d in defaults], *[f"{d} / best fixed N, {gpu}" for d in defaults[:2]],
            "lookup auto tpp / best native"]
    rows = []
    for cat, group in _groups(results):
        cells = [cat]
        for d in defaults:
            sp = _vals(group, cpu, d, "speedup")
            cells.append(f"{gmean(sp):.3f} [{min(sp):.2f}]" if sp else "-")
        for d, prefix in zip(defaults[:2], ["lookup", "draft"]):
            name, value = best_fixed(group, gpu, prefix)
            sp = _vals(group, gpu, d, "speedup")
            cells.append(f"{gmean(sp) / value:.3f} (N={name.split()[-1]})" if name and sp else "-")
        vs = [r["tables"][cpu]["lookup auto"]["tpp"] / max(r["tables"][cpu][n]["tpp"] for n in natives) for r in group]
        cells.append(f"{gmean(vs):.2f} [{min(vs):.2f}]")
        rows.append(cells)
    table(head, rows, f"\n## goals: {title}: geometric mean [worst text]")


def compact(results: list[dict], tables, title: str) -> None:
    """Per category and configuration: modelled speedup over plain under each table (geometric
    mean, worst text), and tokens per pass under the first."""
    names = list(dict.fromkeys(n for r in results for n in r["tables"][tables[0].label]))
    rows = []
    for cat, group in _groups(results):
        cells = [cat, len(group)]
        for name in names:
            parts = []
            for costs in tables:
                sp = _vals(group, costs.label, name, "speedup")
                parts.append(f"{gmean(sp):.3f} [{min(sp):.2f}]" if sp else "-")
            parts.append(f"{gmean(_vals(group, tables[0].label, name, 'tpp')):.2f}")
            cells.append(" / ".join(parts))
        rows.append(cells)
    table(["category", "n", *names], rows, f"\n## {title}: speedup over plain ({' / '.join(t.label for t in tables)}), "
          "geometric mean [worst text] / tokens per pass")
