"""Write the building-block table V-Half and V-Min weigh (vblock_table.py): every block
of each family at p 2-32, built by vblocks.py at the family's memory (controllable.py).
Minutes at p 32; the table is committed, and this is how it was made:

    python -m hpcpipe.schedules.write_vblock_table --table hpcpipe/schedules/vblock_table.py

A module of its own so that neither vblocks nor controllable imports the other.
"""

from __future__ import annotations

import argparse

from .controllable import family_limit
from .vblocks import table_text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcpipe.schedules.write_vblock_table",
                                     description="Write the building-block table V-Half and "
                                     "V-Min weigh (minutes at p 32: every block of the family "
                                     "is built)")
    parser.add_argument("--table", required=True, metavar="PY", help="the module to write")
    parser.add_argument("--most", type=int, default=32, help="largest p (default 32)")
    args = parser.parse_args(argv)
    text = table_text(range(2, args.most + 1),
                      {name: (lambda p, name=name: family_limit(name, p))
                       for name in ("v-half", "v-min")})
    with open(args.table, "w") as out:
        out.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
