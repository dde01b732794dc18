"""`squeeze eval`'s results as the app and the table say them."""

from __future__ import annotations


def full_attention_found(full: dict) -> str:
    """The needles full attention found, as the table's and the app's captions say it ("" without a needles
    part): full is a document's "full" entry (needles_found, needles_cells, needles_decided)."""
    if "needles_found" not in full or "needles_cells" not in full:
        return ""
    line = f"full attention found {full['needles_found']}/{full['needles_cells']} needles"
    if isinstance(full.get("needles_decided"), int):
        line += f", {full['needles_decided']} with no near-tie"
    return line
