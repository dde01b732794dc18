"""The interactive views (plotly figures, shown through Gradio's plot component): (a) the kept fraction per global
layer and query head, hover telling the layer, the head, the kept share and how many keys; (d) the keys of one layer
and KV head on their first two principal components, zoomable, hover telling each key's cluster. A view with
nothing to draw is a figure holding its message."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.render import HIGH, LOW, cluster_colour

FONT = dict(family="system-ui, sans-serif", size=12)
TICK_LABELS_PX = 24  # an axis's tick labels at FONT's size, with their padding
ROLE_NOTE_PX = 30  # the heatmap's R / S note: one line under the head labels
AXIS_TITLE_PX = 48  # the projection's x tick labels and axis title, which its legend goes under
LEGEND_PX = 40  # the projection's legend: one row of four entries (two on a narrow page)
SCALE = [[0.0, "rgb(%d,%d,%d)" % LOW], [1.0, "rgb(%d,%d,%d)" % HIGH]]  # kept fraction 0 -> 1, as the app's CSS


def message_figure(text: str) -> go.Figure:
    """An empty view that says why it is empty."""
    fig = go.Figure()
    fig.add_annotation(text=text, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False, font=FONT)
    fig.update_layout(height=120, margin=dict(l=10, r=10, t=10, b=10), xaxis=dict(visible=False),
                      yaxis=dict(visible=False), plot_bgcolor="white", paper_bgcolor="white")
    return fig


def heatmap_figure(stats: dict) -> go.Figure:
    """(a) Kept fraction [global layer][query head] for the question's prefill and averaged over the answer's steps,
    side by side. For a method whose units are heads (DuoAttention) each cell says R (a retrieval head: every key)
    or S (a streaming head: the first and the last tokens)."""
    layers = list(stats.get("global_layers", []))
    fixed = int(stats.get("fixed_len") or 0)
    steps = max(0, stats.get("steps", 1) - 1)
    roles = (stats.get("extra") or {}).get("unit") == "head"
    panels = [("question prefill", stats.get("kept_fraction_prefill") or []),
              (f"answer ({steps} steps, mean)", stats.get("kept_fraction_decode") or [])]
    fig = make_subplots(rows=1, cols=2, subplot_titles=[title for title, _ in panels], horizontal_spacing=0.12)
    for col, (title, matrix) in enumerate(panels, start=1):
        if not matrix:
            fig.add_annotation(text="no steps (the answer had one token)", showarrow=False, font=FONT,
                               xref=f"x{col if col > 1 else ''} domain", yref=f"y{col if col > 1 else ''} domain",
                               x=0.5, y=0.5)
            continue
        heads = [f"h{h}" for h in range(len(matrix[0]))]
        rows = [f"L{i}" for i in layers[:len(matrix)]]
        keys = [[round(v * fixed) for v in row] for row in matrix]
        text = [[_cell_text(v, roles) for v in row] for row in matrix]
        fig.add_trace(go.Heatmap(
            z=[[100 * v for v in row] for row in matrix], x=heads, y=rows, zmin=0, zmax=100, colorscale=SCALE,
            text=text, texttemplate="%{text}", customdata=keys, name=title, xgap=2, ygap=2,
            showscale=col == 2, colorbar=dict(title="kept %", thickness=10),
            hovertemplate=("layer %{y}, head %{x}<br>%{z:.1f}% of the keys kept (%{customdata} of "
                           f"{fixed})<extra>{title}</extra>")), row=1, col=col)
        fig.update_yaxes(autorange="reversed", row=1, col=col)
    note = ROLE_NOTE_PX if roles else 0  # room under the head labels for the R / S note
    fig.update_layout(height=120 + 34 * max(1, len(layers)) + note, margin=dict(l=10, r=10, t=40, b=10 + note),
                      font=FONT, plot_bgcolor="white", paper_bgcolor="white")
    if roles:  # below the plots' head labels (TICK_LABELS_PX), never on them
        fig.add_annotation(text="R: a retrieval head (every key); S: a streaming head (the first and the last tokens)",
                           x=0, y=0, xref="paper", yref="paper", xanchor="left", yanchor="top",
                           yshift=-TICK_LABELS_PX, showarrow=False, font=FONT)
    return fig


def _cell_text(v: float, roles: bool) -> str:
    if roles:
        return "R" if v >= 1 - 1e-4 else "S"
    return f"{100 * v:.0f}"


def projection_figure(proj) -> go.Figure:
    """(d) Keys on their first two principal components, coloured by cluster: the retrieved clusters' keys bold,
    their centroids as outlined diamonds, the other centroids as small crosses; hover tells a key's cluster and its
    size. Zoom and pan are plotly's."""
    pts, labels, cents, sizes = proj.points, proj.labels, proj.centroids, proj.sizes
    if len(pts) == 0:
        return message_figure("no keys")
    hit = set(int(c) for c in proj.retrieved)
    fig = go.Figure()
    for retrieved in (False, True):
        pick = [i for i, c in enumerate(labels) if (int(c) in hit) == retrieved]
        if not pick:
            continue
        fig.add_trace(go.Scattergl(
            x=[float(pts[i][0]) for i in pick], y=[float(pts[i][1]) for i in pick], mode="markers",
            name="keys of retrieved clusters" if retrieved else "other keys",
            marker=dict(size=6 if retrieved else 4, opacity=0.9 if retrieved else 0.35,
                        color=[cluster_colour(int(labels[i]), 1.0, not retrieved) for i in pick]),
            customdata=[[int(labels[i]), int(sizes[int(labels[i])])] for i in pick],
            hovertemplate="key of cluster %{customdata[0]} (%{customdata[1]} keys)<extra></extra>"))
    shown = [c for c in range(len(cents)) if sizes[c] > 0]
    for retrieved in (False, True):
        pick = [c for c in shown if (c in hit) == retrieved]
        if not pick:
            continue
        fig.add_trace(go.Scatter(
            x=[float(cents[c][0]) for c in pick], y=[float(cents[c][1]) for c in pick], mode="markers",
            name="retrieved centroids" if retrieved else "centroids",
            marker=dict(symbol="diamond" if retrieved else "cross-thin", size=11 if retrieved else 5,
                        color=[cluster_colour(c) for c in pick] if retrieved else "#777",
                        line=dict(width=1.2 if retrieved else 0.8, color="#111" if retrieved else "#777")),
            customdata=[[c, int(sizes[c])] for c in pick],
            hovertemplate=("cluster %{customdata[0]}: %{customdata[1]} keys"
                           + (" (retrieved)" if retrieved else "") + "<extra></extra>")))
    caption = (f"layer {proj.layer}, KV head {proj.kv_head}: {len(pts)} of {proj.total} keys, {len(hit)} of "
               f"{len(shown)} clusters retrieved; the two components hold {100 * proj.explained:.0f}% of the variance")
    plot_px = 330  # the plotting area; the legend sits under the x axis's title, in the bottom margin
    fig.update_layout(title=dict(text=caption, font=dict(size=12)), height=50 + plot_px + AXIS_TITLE_PX + LEGEND_PX,
                      font=FONT, margin=dict(l=10, r=10, t=50, b=AXIS_TITLE_PX + LEGEND_PX), plot_bgcolor="#fcfcfd",
                      paper_bgcolor="white", dragmode="zoom",
                      legend=dict(orientation="h", x=0, xanchor="left", yanchor="top", y=-AXIS_TITLE_PX / plot_px),
                      xaxis=dict(title="component 1", zeroline=False), yaxis=dict(title="component 2", zeroline=False))
    return fig

