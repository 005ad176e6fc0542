"""rtrain's options mistyped on `rtrain launch`'s command line. Pure functions of the tokens.

`rtrain launch` hands every token it does not know to the script, so that a script's own
`--lr 0.1` needs no `--`. The price is that a mistyped rtrain option would pass silently:

- before the script, an unknown `--bogus` would be taken for the script itself; it is a usage
  error naming the nearest rtrain option (`unknown_before_script`);
- after the script, a token one edit away from an rtrain option (`--resum`, `--max-restart`,
  `--ckpt-dri`) is most likely that option mistyped; it still goes to the script, which may
  well have an option of that name, with a one-line warning (`misspelt_after_script`).
  A token that swaps rtrain's `-` for `_` (`--ckpt_dir`) is an argparse-style option of the
  script's own, not a typo: rtrain's options never hold `_`. Tokens after `--` are the
  script's by the person's own word and never judged.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence


def one_edit_away(a: str, b: str) -> bool:
    """`a` and `b` differ by exactly one insertion, deletion, substitution or swap of two
    neighbouring characters."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
        if len(diff) == 1:
            return True
        return (len(diff) == 2 and diff[1] == diff[0] + 1
                and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]])
    short, long = (a, b) if len(a) < len(b) else (b, a)
    i = next((k for k, (x, y) in enumerate(zip(short, long[:len(short)], strict=True))
              if x != y), len(short))
    return short[i:] == long[i + 1:]


def _name(token: str) -> str:
    return token.partition("=")[0]


def nearest(token: str, options: Iterable[str]) -> str | None:
    """The rtrain option nearest to `token`: one edit away, else the most similar; None only
    without options."""
    name = _name(token)
    known = sorted(o for o in options if o.startswith("--") == name.startswith("--")) or sorted(
        options)
    close = [o for o in known if one_edit_away(name, o)]
    if close:
        return close[0]
    hint = difflib.get_close_matches(name, known, n=1, cutoff=0.0)
    return hint[0] if hint else None


def unknown_before_script(token: str, options: Iterable[str]) -> str:
    """The usage error's sentence for an unknown option where the script should be."""
    name = _name(token)
    hint = nearest(name, options)
    tail = f"the nearest is {hint}" if hint else "rtrain launch --help lists them"
    return (f"no such option {name} for rtrain launch ({tail}); the script's own options go "
            "after the script")


def misspelt_after_script(tokens: Sequence[str], options: Iterable[str]) -> list[str]:
    """One warning line for each long option among `tokens` (the script's arguments, those
    after `--` left out) that is one edit away from an rtrain option."""
    known = sorted(o for o in options if o.startswith("--"))
    lines = []
    for token in tokens:
        name = _name(token)
        if not name.startswith("--") or name in known:
            continue
        meant = next((o for o in known if one_edit_away(name, o)), None)
        if meant is None or name.replace("_", "-") == meant:
            continue
        lines.append(f"{name} looks like rtrain's {meant}; it goes to the script as written "
                     f"(rtrain options are spelt exactly and go before the script)")
    return lines
