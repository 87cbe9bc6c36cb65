"""`minisgl serve` on the scheduler chapter's `ToyEngine`: the server's plumbing without weights (for tests only).

Takes `minisgl serve`'s options (the same generated parser) and runs the same `serve`, with an `engine_factory`."""
from __future__ import annotations

import sys

from minisgl.cli import args_from, build_parser
from minisgl.server import ServerArgs, serve
from server_utils import toy_engine

if __name__ == "__main__":
    argv, faulty, delay = sys.argv[1:], None, 0.0
    if "--faulty-seed" in argv:      # the test hook: requests with this seed fail inside the engine
        i = argv.index("--faulty-seed"); faulty = int(argv[i + 1]); del argv[i:i + 2]
    if "--step-delay" in argv:       # the test hook: each forward sleeps this long (requests stay in flight)
        i = argv.index("--step-delay"); delay = float(argv[i + 1]); del argv[i:i + 2]
    args = args_from(build_parser().parse_args(["serve", *argv]), ServerArgs)
    sys.exit(serve(args, engine_factory=toy_engine(args, faulty, delay)))
