"""The interactive explorer behind ``notebooks/00_explore.ipynb`` (ipywidgets).

Two panels, both plain Python objects so they are testable without a browser:

* :class:`CaseExplorer` -- pick a case and its parameters (widgets are built
  from the case's :class:`~ddplab.parameters.ParameterSet`), press *Run* to
  launch the ranks in the background, watch one progress bar per run fill
  from the records the ranks stream back, and get the case's figures and
  verdict when it finishes; *Stop* ends a running launch cleanly.
* :class:`NumericsPlayground` -- no processes: choose dtype, W (up to 1024
  virtual ranks), a value distribution and reduction orders, and see the
  histogram of ulp errors per order, the error / bound ratio and the
  fraction correctly rounded, recomputed on every change.

Example::

    from ddplab.explore import CaseExplorer, NumericsPlayground
    CaseExplorer()          # displays the case panel
    NumericsPlayground()    # displays the numerics panel
"""
from __future__ import annotations

import html
import threading
import time
from typing import Any

import ipywidgets as w
import matplotlib.pyplot as plt
import torch

from ddplab import launcher
from ddplab.cases import Case, case_names, get_case
from ddplab.parameters import Parameter
from ddplab.plots import png_bytes, theme

__all__ = ["CaseExplorer", "NumericsPlayground", "parameter_widget", "playground_contributions",
           "DISTRIBUTIONS", "PLAYGROUND_ORDERS"]

#: Value distributions of the numerics playground.
DISTRIBUTIONS = ("normal", "heavy-tailed", "cancellation-heavy")
#: Orders offered by the playground (those of :func:`ddplab.numerics.orders.reduce`, minus exact).
PLAYGROUND_ORDERS = ("sequential", "reverse", "pairwise", "gloo_ring", "nccl_ring", "nccl_tree")
#: Largest W the playground offers.
MAX_VIRTUAL_RANKS = 1024
#: Up to this many W×N elements the playground holds the data; beyond, ranks are generated on demand.
MATERIALIZE_LIMIT = 1 << 25


# --------------------------------------------------------------------------- widgets from parameters


def parameter_widget(p: Parameter) -> w.Widget:
    """A widget for one case parameter; its ``.value`` is valid input for ``p.coerce``."""
    style = {"description_width": "120px"}
    layout = w.Layout(width="420px")
    common = dict(description=p.name, tooltip=p.help, style=style, layout=layout)
    if p.kind == "bool":
        return w.Checkbox(value=bool(p.default), indent=False, **common)
    if p.kind == "list[str]" and p.choices:
        return w.SelectMultiple(options=list(p.choices), value=tuple(p.default), rows=min(6, len(p.choices)),
                                **common)
    if p.kind in ("str", "path") and p.choices:
        return w.Dropdown(options=list(p.choices), value=p.default, **common)
    if p.kind == "int" and p.minimum is not None and p.maximum is not None:
        return w.BoundedIntText(value=p.default, min=p.minimum, max=p.maximum, **common)
    if p.kind == "int":
        return w.IntText(value=p.default, **common)
    if p.kind == "float":
        return w.FloatText(value=p.default, **common)
    text = "" if p.default is None else (", ".join(map(str, p.default)) if isinstance(p.default, list)
                                         else str(p.default))
    return w.Text(value=text, placeholder="None" if p.nullable else "", **common)


def _widget_value(widget: w.Widget, p: Parameter) -> Any:
    value = widget.value
    if isinstance(value, tuple):
        return list(value)
    if isinstance(widget, w.Text) and p.nullable and not value.strip():
        return None
    return value


# --------------------------------------------------------------------------- case explorer


class CaseExplorer:
    """Run a case from widgets: parameters, Run/Stop, per-run progress, figures, verdict."""

    def __init__(self, case: "str | Case" = "backend_divergence", *, extra_cases: tuple = (),
                 **values: Any):
        # Built-in cases plus any given by module path (or as Case objects), loaded when picked.
        chosen = get_case(case)
        self._cases: dict[str, Any] = {name: name for name in case_names()}
        for extra in (*extra_cases, case):
            self._cases[get_case(extra).name] = extra
        self.case_picker = w.Dropdown(options=list(self._cases), value=chosen.name,
                                      description="case",
                                      style={"description_width": "120px"}, layout=w.Layout(width="420px"))
        self.form = w.VBox()
        self.run_button = w.Button(description="Run", button_style="primary", icon="play")
        self.stop_button = w.Button(description="Stop", button_style="danger", icon="stop", disabled=True)
        self.status = w.HTML("ready")
        self.bars = w.VBox()
        self.output = w.Output()
        self.output.add_class("ddplab-explorer-output")
        self.widget = w.VBox([self.case_picker, self.form,
                              w.HBox([self.run_button, self.stop_button, self.status]),
                              self.bars, self.output])
        self.records = None
        self.verdict = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._bar_for: dict[tuple, w.IntProgress] = {}
        self._steps = 1
        self.case_picker.observe(lambda change: self._build_form(), names="value")
        self.run_button.on_click(lambda _: self.run())
        self.stop_button.on_click(lambda _: self.stop())
        self._build_form(values)

    # -- form ------------------------------------------------------------------------

    def _build_form(self, values: dict | None = None) -> None:
        self.case = get_case(self._cases[self.case_picker.value])
        self.inputs = {}
        for p in self.case.parameters:
            widget = parameter_widget(p)
            if values and p.name in values:
                widget.value = values[p.name]
            self.inputs[p.name] = widget
        self.quick_button = w.Button(description="quick values", tooltip="small parameters: seconds per run")
        self.quick_button.on_click(lambda _: self.set_values(**self.case.quick))
        self.form.children = [w.HTML(f"<i>{html.escape(self.case.title)}</i>"),
                              *self.inputs.values(), self.quick_button]

    def set_values(self, **values: Any) -> None:
        """Set parameter widgets by name (lists for multi-selects)."""
        for name, value in values.items():
            if name not in self.inputs:
                raise ValueError(f"case {self.case.name!r} has no parameter {name!r}")
            widget = self.inputs[name]
            if isinstance(widget, w.SelectMultiple):
                value = tuple(value)
            elif isinstance(widget, w.Text) and isinstance(value, list):
                value = ", ".join(map(str, value))
            widget.value = value

    def params(self) -> dict:
        """The validated parameters the widgets describe (ValueError naming a bad one)."""
        raw = {name: _widget_value(widget, self.case.parameters[name])
               for name, widget in self.inputs.items()}
        return self.case.check_params(raw)

    # -- running ---------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def run(self) -> None:
        """Validate, then launch the case in a background thread (the UI stays live)."""
        if self.running:
            return
        try:
            params = self.params()
        except ValueError as exc:
            self.status.value = f"<span style='color:#c62828'>{html.escape(str(exc))}</span>"
            return
        self.records = self.verdict = self.error = None
        self._bar_for = {}
        self.bars.children = []
        self._steps = self.case.progress_total(params)
        self.output.clear_output()
        self.run_button.disabled = True
        self.stop_button.disabled = False
        self.status.value = "running…"
        self._thread = threading.Thread(target=self._run, args=(params,), daemon=True,
                                        name="ddplab-explorer")
        self._thread.start()

    def stop(self) -> None:
        """End the running launch (every rank stops; records so far are kept)."""
        if self.running:
            self.status.value = "stopping…"
            launcher.stop_all()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the background run ends (for scripts and tests)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _bar(self, runner, rec: dict) -> w.IntProgress | None:
        if rec.get("rank") not in (0, None):
            return None
        label = rec.get(self.case.run_label, "") if self.case.run_label else ""
        key = (id(runner), str(label))
        bar = self._bar_for.get(key)
        if bar is None:
            desc = f"W={runner.world_size} {label}".strip()
            bar = w.IntProgress(value=0, min=0, max=max(1, self._steps), description=desc[:28],
                                style={"description_width": "200px"}, layout=w.Layout(width="520px"))
            self._bar_for[key] = bar
            self.bars.children = list(self.bars.children) + [bar]
        return bar

    def _on_record(self, runner, rec: dict) -> None:
        bar = self._bar(runner, rec)
        if bar is not None and rec.get("step") is not None:
            bar.value = min(bar.max, max(bar.value, int(rec["step"]) + 1))

    def _run(self, params: dict) -> None:
        t0 = time.perf_counter()
        try:
            with launcher.observe(self._on_record):
                records = self.case.run(params, progress=False)
            self.records = records
            for bar in self._bar_for.values():
                bar.value, bar.bar_style = bar.max, "success"
            self.verdict = self.case.verdict(records, params)
            figures = self.case.figures(records, params)
            # append_* rather than `with self.output:`, which captures only on
            # the kernel's main thread and this runs in a background thread.
            from IPython.display import Image
            self.output.append_display_data(self.verdict)
            for fig in figures:
                self.output.append_display_data(Image(data=png_bytes(fig), format="png"))
                plt.close(fig)
            self.status.value = f"done in {time.perf_counter() - t0:.1f} s: {len(records)} records"
        except launcher.LaunchStopped as exc:
            self.error = exc
            self.records = exc.records
            for bar in self._bar_for.values():
                bar.bar_style = "warning"
            self.status.value = f"stopped after {time.perf_counter() - t0:.1f} s ({len(exc.records)} records kept)"
        except BaseException as exc:  # noqa: BLE001 - shown in the panel, kept on .error
            self.error = exc
            for bar in self._bar_for.values():
                bar.bar_style = "danger"
            self.status.value = f"<span style='color:#c62828'>failed: {html.escape(str(exc).splitlines()[0])}</span>"
            self.output.append_stderr(f"{exc}\n")
        finally:
            self.run_button.disabled = False
            self.stop_button.disabled = True

    def _ipython_display_(self) -> None:
        from IPython.display import display
        display(self.widget)


# --------------------------------------------------------------------------- numerics playground


def playground_contributions(distribution: str, world_size: int, numel: int, dtype: torch.dtype,
                             seed: int = 0):
    """W virtual ranks of ``numel`` values, generated per rank (memory O(numel)).

    normal: N(0, 1). heavy-tailed: Student's t with 1.5 degrees of freedom
    (infinite variance: a few huge addends dominate). cancellation-heavy:
    large values whose sum over ranks nearly cancels (rank W−1 holds minus the
    others' sum of a large common part), so |S| ≪ Σ|x_r|. Up to
    :data:`MATERIALIZE_LIMIT` elements the data is generated once and held;
    beyond, each rank's row is regenerated on demand (memory O(numel)).
    """
    from ddplab.numerics.contributions import as_contributions

    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {distribution!r}; choose one of {', '.join(DISTRIBUTIONS)}")
    if not 1 <= world_size <= MAX_VIRTUAL_RANKS:
        raise ValueError(f"world_size must be in 1..{MAX_VIRTUAL_RANKS}, got {world_size}")

    def gen(rank: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1_000_003 + rank)
        if distribution == "normal":
            x = torch.randn(numel, generator=g, dtype=torch.float64)
        elif distribution == "heavy-tailed":
            u = torch.rand(numel, generator=g, dtype=torch.float64).clamp_min(1e-12)
            x = torch.randn(numel, generator=g, dtype=torch.float64) / u.pow(1 / 1.5)
        else:
            big = lambda r: torch.randn(numel, generator=torch.Generator().manual_seed(seed * 7919 + r),
                                        dtype=torch.float64) * 1e3
            small = torch.randn(numel, generator=g, dtype=torch.float64)
            if rank < world_size - 1 or world_size == 1:
                x = big(rank) + small
            else:
                x = -sum(big(r) for r in range(world_size - 1)) + small
        return x.to(dtype)

    if world_size * numel <= MATERIALIZE_LIMIT:
        # Small enough to hold: generate once instead of once per order and metric.
        return as_contributions(torch.stack([gen(r) for r in range(world_size)]))
    return as_contributions(gen, world_size=world_size)


#: The collectives the playground emulates, and the orders each offers.
PLAYGROUND_OPERATIONS = {
    "all-reduce": PLAYGROUND_ORDERS,
    # NCCL runs reduce-scatter on rings (no tree); gloo's is its ring all-reduce, sliced.
    "reduce-scatter": ("sequential", "reverse", "pairwise", "gloo_ring", "nccl_ring"),
}


def playground_numel(operation: str, numel: int, world_size: int) -> int:
    """The element count the playground reduces: a reduce-scatter needs a multiple of W (rounded up)."""
    if operation not in PLAYGROUND_OPERATIONS:
        raise ValueError(f"unknown operation {operation!r}; choose one of {', '.join(PLAYGROUND_OPERATIONS)}")
    return -(-numel // world_size) * world_size if operation == "reduce-scatter" else numel


class NumericsPlayground:
    """Ulp errors of emulated all-reduce or reduce-scatter orders against the exact sum, recomputed live."""

    def __init__(self, dtype: str = "float32", world_size: int = 8, distribution: str = "normal",
                 orders: tuple[str, ...] = ("sequential", "pairwise", "gloo_ring", "nccl_ring"),
                 numel: int = 20_000, seed: int = 0, operation: str = "all-reduce"):
        style = {"description_width": "120px"}
        playground_numel(operation, numel, world_size)    # an unknown operation raises here
        self.operation = w.ToggleButtons(options=list(PLAYGROUND_OPERATIONS), value=operation,
                                         description="operation", style=style)
        self.dtype = w.Dropdown(options=["float16", "bfloat16", "float32", "float64"], value=dtype,
                                description="dtype", style=style)
        self.world_size = w.SelectionSlider(options=sorted({2 ** k for k in range(1, 11)} | {3, 5, 6, 7}),
                                            value=world_size, description="W (ranks)", style=style)
        self.distribution = w.Dropdown(options=list(DISTRIBUTIONS), value=distribution,
                                       description="values", style=style)
        offered = PLAYGROUND_OPERATIONS[operation]
        self.orders = w.SelectMultiple(options=list(offered), value=tuple(o for o in orders if o in offered),
                                       description="orders", rows=len(PLAYGROUND_ORDERS), style=style)
        self.numel = w.BoundedIntText(value=numel, min=1, max=2_000_000, description="elements", style=style)
        self.seed = w.IntText(value=seed, description="seed", style=style)
        self.table = w.HTML()
        self.figure = w.Image(format="png")
        self.figure.add_class("ddplab-playground-figure")
        self.status = w.HTML()
        controls = [self.dtype, self.world_size, self.distribution, self.orders, self.numel, self.seed]
        self.widget = w.VBox([self.operation, w.HBox([w.VBox(controls[:3]), w.VBox(controls[3:])]),
                              self.status, self.table, self.figure])
        self.results: dict[str, dict] = {}
        for c in controls:
            c.observe(lambda change: self.update(), names="value")
        self.operation.observe(lambda change: self._offer_orders(), names="value")
        self.update()

    def _offer_orders(self) -> None:
        """Offer the chosen operation's orders, keeping the chosen ones it has; then recompute."""
        offered = PLAYGROUND_OPERATIONS[self.operation.value]
        keep = tuple(o for o in self.orders.value if o in offered) or offered[:1]
        self._switching = True      # no recomputation for the intermediate states
        try:
            self.orders.options = list(offered)
            self.orders.value = keep
        finally:
            self._switching = False
        self.update()

    def compute(self) -> dict[str, dict]:
        """Per order: measure() of the emulated result and the ulp errors per element.

        A reduce-scatter's result is every rank's shard, concatenated; its
        element count is rounded up to a multiple of W.
        """
        from ddplab.numerics.accuracy import measure
        from ddplab.numerics.exact import exact_parts, round_to_dtype
        from ddplab.numerics.fpformat import parse_dtype
        from ddplab.numerics.orders import reduce
        from ddplab.numerics.reduce_scatter import reduce_scatter
        from ddplab.numerics.ulp import ulp_distance

        dtype = parse_dtype(self.dtype.value)
        operation = self.operation.value
        numel = playground_numel(operation, self.numel.value, self.world_size.value)
        contributions = playground_contributions(self.distribution.value, self.world_size.value,
                                                 numel, dtype, self.seed.value)
        hi, lo = exact_parts(contributions)
        exact = round_to_dtype(hi, lo, dtype)
        collective = reduce_scatter if operation == "reduce-scatter" else reduce
        out = {}
        for order in self.orders.value:
            # Rings and fixed orders have the same depth in both collectives, so one bound serves.
            result = collective(contributions, order)
            metrics = measure(result, contributions, order, reference=(hi, lo))
            metrics["ulp_errors"] = ulp_distance(result, exact)
            out[order] = metrics
        return out

    def update(self) -> None:
        """Recompute and redraw (called on every widget change)."""
        if getattr(self, "_switching", False):
            return
        if not self.orders.value:
            self.status.value = "choose at least one order"
            return
        t0 = time.perf_counter()
        try:
            self.results = self.compute()
        except ValueError as exc:
            self.status.value = f"<span style='color:#c62828'>{html.escape(str(exc))}</span>"
            return
        rows = "".join(
            f"<tr><td>{o}</td><td>{m['max_ulp']:.0f}</td><td>{m['mean_ulp']:.3f}</td>"
            f"<td>{m['frac_correctly_rounded']:.4f}</td><td>{m['max_bound_ratio']:.3g}</td>"
            f"<td>{m['classification']}</td></tr>" for o, m in self.results.items())
        self.table.value = ("<table><tr><th>order</th><th>max ulp</th><th>mean ulp</th>"
                            "<th>correctly rounded</th><th>max error / bound</th><th>verdict</th></tr>"
                            f"{rows}</table>")
        self.figure.value = self._histogram()
        numel = playground_numel(self.operation.value, self.numel.value, self.world_size.value)
        self.status.value = (f"{self.operation.value}, W={self.world_size.value}, {numel} elements, "
                             f"{self.dtype.value}, {self.distribution.value}: "
                             f"{time.perf_counter() - t0:.2f} s")

    def _histogram(self) -> bytes:
        with theme():
            fig, ax = plt.subplots(figsize=(7, 3.2))
            for order, m in self.results.items():
                errors = m["ulp_errors"].to(torch.float64)
                lo, hi = int(errors.min()), int(errors.max())
                bins = torch.arange(lo - 0.5, hi + 1.5, max(1, (hi - lo + 1) // 60), dtype=torch.float64)
                counts = torch.histogram(errors, bins=bins).hist
                ax.step(((bins[:-1] + bins[1:]) / 2).numpy(), counts.numpy(), where="mid", label=order)
            ax.set_yscale("log")
            ax.set_xlabel("signed ulp error vs the correctly rounded sum")
            ax.set_ylabel("elements")
            ax.legend(fontsize=8)
            fig.tight_layout()
            data = png_bytes(fig)
            plt.close(fig)
        return data

    def _ipython_display_(self) -> None:
        from IPython.display import display
        display(self.widget)
