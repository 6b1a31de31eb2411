"""Tables that fit the terminal: one row per record when they fit, one block per record when not.

Numbers are never cut. Number columns never wrap, and the width they need is reserved. Text
columns (names, models, formats) wrap, or fold words longer than TEXT_MIN. When even that is
too wide, the table is split into narrower ones (if the caller said how), and below that it
gives way to a block per record: its identifying cells on one line, then `label value` pairs
laid out across the width.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rich.columns import Columns
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

# How narrow a text column may fold before the table gives way: node ranges, GPU and model
# names mostly fit in this, so only longer words (hostnames, long model names) are ever folded.
TEXT_MIN = 14
_UNBOUNDED = 100_000

Cell = str | Text


@dataclass(frozen=True)
class Col:
    """One column. A newline in `header` splits it over lines in the table (not in blocks)."""

    header: str
    numeric: bool = False  # never wraps; right-justified unless `left`
    head: bool = False  # in blocks, part of the record's first line rather than a pair
    left: bool = False

    @property
    def label(self) -> str:
        return " ".join(self.header.split())


class Records:
    """A titled list of records, drawn as a table or as blocks, whichever the width allows."""

    def __init__(
        self,
        title: str,
        cols: Sequence[Col],
        rows: Iterable[Sequence[Cell]],
        *,
        styles: Sequence[str | None] | None = None,
        caption: str | None = None,
        parts: Sequence[Sequence[int]] = (),
    ) -> None:
        """`parts`: column indexes of narrower tables to try before blocks (heads are added)."""
        self.title, self.cols, self.caption = title, list(cols), caption
        self.parts = [list(p) for p in parts]
        self.rows = [list(r) for r in rows]
        for r in self.rows:
            assert len(r) == len(self.cols), (self.title, r)
        self.styles = list(styles) if styles is not None else [None] * len(self.rows)

    def part(self, index: Sequence[int], title: str | None, caption: str | None) -> Records:
        """These columns alone, after the head columns."""
        keep = [i for i, c in enumerate(self.cols) if c.head and i not in index] + list(index)
        return Records(
            title or "",
            [self.cols[i] for i in keep],
            ([row[i] for i in keep] for row in self.rows),
            styles=self.styles,
            caption=caption,
        )

    def table(self, fold_text_to: int | None = None) -> Table:
        """The one-row-per-record table; `fold_text_to` cuts text cells (to measure only)."""
        t = Table(
            title=self.title or None,
            title_justify="left",
            header_style="bold",
            pad_edge=False,
            caption=self.caption,
            caption_justify="left",
        )
        for c in self.cols:
            if c.numeric:
                t.add_column(c.header, justify="left" if c.left else "right", no_wrap=True)
            else:
                t.add_column(c.header, overflow="fold")
        for row, style in zip(self.rows, self.styles, strict=True):
            cells = [
                _cut(cell, fold_text_to) if fold_text_to and not c.numeric else cell
                for c, cell in zip(self.cols, row, strict=True)
            ]
            t.add_row(*cells, style=style)
        return t

    def blocks(self) -> Group:
        parts: list[RenderableType] = [Text(self.title, style="table.title")]
        for row, style in zip(self.rows, self.styles, strict=True):
            heads = [_text(cell) for c, cell in zip(self.cols, row, strict=True) if c.head]
            first = Text(" ").join(h for h in heads if h.plain.strip())
            if style:
                first.stylize(style)
            pairs = [
                Text.assemble((c.label, "dim"), " ", _text(cell))
                for c, cell in zip(self.cols, row, strict=True)
                if not c.head and _text(cell).plain.strip()
            ]
            parts.append(first)
            if pairs:
                parts.append(Padding(Columns(pairs, padding=(0, 3)), (0, 0, 0, 2)))
        if self.caption:
            parts.append(Text(self.caption, style="table.caption"))
        return Group(*parts)

    def min_table_width(self, console: Console, options: ConsoleOptions) -> int:
        """The narrowest the table can be with numbers whole and text no shorter than TEXT_MIN."""
        probe = self.table(fold_text_to=TEXT_MIN)
        return Measurement.get(console, options.update_width(_UNBOUNDED), probe).minimum

    def fits(self, console: Console, options: ConsoleOptions) -> bool:
        return self.min_table_width(console, options) <= options.max_width

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if self.fits(console, options):
            yield self.table()
            return
        last = len(self.parts) - 1
        parts = [
            self.part(p, self.title if k == 0 else None, self.caption if k == last else None)
            for k, p in enumerate(self.parts)
        ]
        if parts and all(p.fits(console, options) for p in parts):
            yield Group(*(p.table() for p in parts))
        else:
            yield self.blocks()

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        wide = Measurement.get(console, options, self.table())
        return Measurement(min(wide.minimum, options.max_width), wide.maximum)


def _text(cell: Cell) -> Text:
    return cell.copy() if isinstance(cell, Text) else Text(cell)


def _cut(cell: Cell, width: int) -> Text:
    """Each word of `cell` cut to `width`: a column folded that far still shows this much."""
    text = _text(cell)
    return Text(" ".join(word[:width] for word in text.plain.split()), style=text.style)
