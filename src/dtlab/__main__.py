import logging
import os
import sys

from dtlab.cli import main
from dtlab.runtime.status import is_worker_env

code = main()
if is_worker_env():
    # A worker that finished (its process group destroyed, its files closed) leaves without the
    # interpreter's teardown: destroying torch's C++ objects there (gloo's threads) can abort the
    # process ("terminate called without an active exception", SIGABRT) after a run that succeeded,
    # and the launcher would report a failure that did not happen.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
