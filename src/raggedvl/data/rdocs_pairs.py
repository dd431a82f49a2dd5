"""Query/page pairs for the embedded "rdocs" dataset, read from the R manuals' own structure.

Recipe (see the project's DATA.md): each bookmark of a manual's outline gives a title, a page
and a vertical position; for the reference manual (``refman.pdf``) the query is the
plain-English title printed on the help page's first line ("Sample Quantiles"), for the other
manuals it is the section title with its number stripped. Generic titles (Introduction,
Index, ...), one-word titles and query strings that occur more than once are dropped; each
page keeps its first remaining query. Everything here is a pure function of the PDF bytes.

Per pair, a SHA-256 hash of ``(version, pdf, page)`` chooses the rendering resolution
(60-150 dpi), the view (full page 70 %, section crop 15 %, two-page spread 15 %) and the
train/dev split, so the dataset is the same on every machine and any subset of it is too.
Units: positions and sizes in PDF points (1/72 inch), origin bottom-left as in PDF.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import pypdfium2 as pdfium

RDOCS_VERSION = "v2"  # output format / content version: names the cache directory
_HASH_SALT = "rdocs-v1"  # seeds views, dpi and splits; changing it reshuffles the dataset
REFMAN = "refman.pdf"
MANUALS = (
    "R-FAQ.pdf",
    "R-admin.pdf",
    "R-data.pdf",
    "R-exts.pdf",
    "R-intro.pdf",
    "R-ints.pdf",
    "R-lang.pdf",
    REFMAN,
)
DPI_RANGE = (60, 150)
DEV_FRACTION = 0.2
MIN_CROP_HEIGHT_PT = 82.0  # a crop of a full-width page is at most 612/82 ~ 7.5 : 1
_CROP_MARGIN_PT = 6.0
_GENERIC = {
    "abstract", "acknowledgements", "acknowledgments", "appendix", "bibliography", "concept index",
    "contents", "description", "details", "examples", "function and variable index", "index",
    "introduction", "key index", "overview", "preface", "references", "see also", "summary",
    "table of contents", "the base package", "usage", "value", "variable and function index",
    "environment variable index",
}
# "2.3 ", "A.1 ", "Appendix B ": always a section number. A lone capital ("A Sample session",
# "B Invoking R") is an appendix number only on a chapter (outline level 0) entry, since
# "A specific example" or "R and statistics" are ordinary titles.
_SECTION_NUMBER = re.compile(r"^(appendix\s+[A-Z]\s+|[A-Z](\.\d+)+\.?\s+|\d+(\.\d+)*\.?\s+)", re.IGNORECASE)
_APPENDIX_LETTER = re.compile(r"^[A-Z]\s+")
_INVISIBLE = dict.fromkeys(map(ord, "\u00ad\ufffe\ufeff\u200b\x02"), None)


@dataclass(frozen=True)
class Heading:
    """One outline entry: its page (0-based), its top in points, and its cleaned query text."""

    pdf: str
    page: int
    top_pt: float
    query: str
    source: str  # "outline" (section title) or "help_title" (refman help-page title)


@dataclass(frozen=True)
class PairPlan:
    """A (query, page) pair and how to render it; ``crop_pt`` = (top, bottom) for crops."""

    id: str
    pdf: str
    page: int
    query: str
    source: str
    split: str
    view: str  # "full" | "crop" | "spread"
    dpi: int
    crop_pt: tuple[float, float] | None
    rank_key: int  # deterministic order used to pick subsets

    @property
    def pages(self) -> list[int]:
        return [self.page, self.page + 1] if self.view == "spread" else [self.page]


def clean_title(raw: str, chapter: bool = False) -> str:
    """Strip soft hyphens, section numbers ("2.3 ", "A.1 ", "Appendix B ", and "A " on a
    ``chapter`` entry) and extra spaces."""
    text = " ".join(raw.translate(_INVISIBLE).split())
    stripped = _SECTION_NUMBER.sub("", text)
    if chapter and stripped == text:
        stripped = _APPENDIX_LETTER.sub("", text)
    return stripped.strip()


def is_useful_query(query: str) -> bool:
    """False for generic titles (Introduction, Index, ...) and one-word titles."""
    folded = query.casefold().rstrip(".:")
    if folded in _GENERIC or folded.endswith(" index"):
        return False
    return len(query.split()) >= 2


def _help_title(page: pdfium.PdfPage, topic: str, top_pt: float) -> str:
    """The title printed beside a refman topic name at ``top_pt`` ("quantile Sample Quantiles")."""
    width, _ = page.get_size()
    textpage = page.get_textpage()
    text = textpage.get_text_bounded(0, top_pt - 40.0, width, top_pt + 2.0)
    textpage.close()  # pdfium objects are freed explicitly; the document would keep them alive
    lines = [" ".join(line.translate(_INVISIBLE).split()) for line in text.splitlines()]
    kept: list[str] = []
    for line in lines:
        if not line or line in ("Description", "Usage") or len(kept) == 2:
            break
        kept.append(line)
    title = " ".join(kept)
    if title.startswith(topic):
        title = title[len(topic):]
    return title.strip()


def read_headings(pdf: pdfium.PdfDocument, name: str) -> list[Heading]:
    """All outline entries of one manual with a destination, in outline order."""
    headings = []
    for item in pdf.get_toc(max_depth=8):
        dest = item.get_dest()
        if dest is None or dest.get_index() is None:
            continue
        _, view = dest.get_view()
        page_index = dest.get_index()
        title = item.get_title()
        if name == REFMAN and item.level != 1:
            continue
        page = pdf[page_index]
        top_pt = float(view[1]) if len(view) > 1 else float(page.get_size()[1])
        if name == REFMAN:
            query = _help_title(page, title, top_pt)
            source = "help_title"
        else:
            query = clean_title(title, chapter=item.level == 0)
            source = "outline"
        page.close()
        headings.append(Heading(name, page_index, top_pt, query, source))
    return headings


def _page_height(pdf: pdfium.PdfDocument, index: int) -> float:
    page = pdf[index]
    height = float(page.get_size()[1])
    page.close()
    return height


def _hash(pdf: str, page: int) -> bytes:
    return hashlib.sha256(f"{_HASH_SALT}|{pdf}|{page}".encode()).digest()


def _crop_bounds(heading: Heading, headings_on_page: list[Heading], page_height: float) -> tuple[float, float] | None:
    """(top, bottom) in points from this heading to the next one on the page, or None if too short."""
    top = min(page_height, heading.top_pt + _CROP_MARGIN_PT)
    below = [h.top_pt for h in headings_on_page if h.top_pt < heading.top_pt - 1.0]
    bottom = max(below) + _CROP_MARGIN_PT if below else 0.0
    return (top, bottom) if top - bottom >= MIN_CROP_HEIGHT_PT else None


def plan_pairs(manuals: dict[str, pdfium.PdfDocument], dev_fraction: float = DEV_FRACTION) -> list[PairPlan]:
    """Every (query, page) pair of the dataset with its view, dpi and split, in manual/page order.

    ``manuals`` maps file name to an open document. A spread shows page p+1 too; when p+1 is
    itself a positive page (or does not exist) the pair is rendered as a full page instead, so
    no document image shows another query's answer.
    """
    all_headings = {name: read_headings(doc, name) for name, doc in manuals.items()}
    counts: dict[str, int] = {}
    for headings in all_headings.values():
        for h in headings:
            counts[h.query.casefold()] = counts.get(h.query.casefold(), 0) + 1
    chosen: dict[tuple[str, int], Heading] = {}
    for name, headings in all_headings.items():
        for h in headings:
            if is_useful_query(h.query) and counts[h.query.casefold()] == 1:
                chosen.setdefault((name, h.page), h)
    plans = []
    for (name, page), heading in sorted(chosen.items()):
        digest = _hash(name, page)
        u_view = int.from_bytes(digest[0:4], "big") / 2**32
        dpi = DPI_RANGE[0] + int.from_bytes(digest[4:6], "big") % (DPI_RANGE[1] - DPI_RANGE[0] + 1)
        split = "dev" if int.from_bytes(digest[6:8], "big") / 2**16 < dev_fraction else "train"
        view, crop = "full", None
        if u_view >= 0.85 and page + 1 < len(manuals[name]) and (name, page + 1) not in chosen:
            view = "spread"
        elif 0.70 <= u_view < 0.85:
            same_page = [h for h in all_headings[name] if h.page == page]
            crop = _crop_bounds(heading, same_page, _page_height(manuals[name], page))
            view = "crop" if crop is not None else "full"
        plans.append(
            PairPlan(
                id=f"{name.removesuffix('.pdf')}-p{page:04d}",
                pdf=name,
                page=page,
                query=heading.query,
                source=heading.source,
                split=split,
                view=view,
                dpi=dpi,
                crop_pt=crop,
                rank_key=int.from_bytes(digest[8:16], "big"),
            )
        )
    return plans


def select_subset(plans: list[PairPlan], train_limit: int | None, dev_limit: int | None) -> list[PairPlan]:
    """At most ``train_limit`` train and ``dev_limit`` dev pairs, chosen by hash rank (stable:
    a smaller subset is contained in a larger one), returned in manual/page order."""
    for label, value in (("train_limit", train_limit), ("dev_limit", dev_limit)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{label} must be a positive integer or None, got {value!r}")
    keep: set[str] = set()
    for split, limit in (("train", train_limit), ("dev", dev_limit)):
        ranked = sorted((p for p in plans if p.split == split), key=lambda p: (p.rank_key, p.id))
        keep.update(p.id for p in (ranked if limit is None else ranked[:limit]))
    return [p for p in plans if p.id in keep]
