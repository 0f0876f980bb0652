import sys

from dtlab.cli import main
from dtlab.runtime.status import is_worker_env, leave_worker

code = main()
if is_worker_env():
    leave_worker(code)  # see there: the interpreter's teardown can abort a finished worker
sys.exit(code)
