"""User-facing errors. The CLI turns these into a short message and a non-zero exit, never a traceback."""


class DtlabError(Exception):
    """Base class for mistakes in what the user gave us (config, data, paths, CLI)."""

    exit_code = 2


class ConfigError(DtlabError):
    """A config key has a value that is not allowed, or keys contradict each other."""


class DataError(DtlabError):
    """A data source is missing, unreadable, empty or too short."""


class CheckpointError(DtlabError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the run that loads it."""


class CollectiveError(DtlabError):
    """A collective failed or timed out (a rank died, hung, or issued another collective).

    A failure of the run, not of its input; the message says which rank is behind, or how the ranks'
    collectives differ (see ``dtlab.parallel.ledger``).
    """

    exit_code = 1


class OutputError(DtlabError):
    """The run trained, but what it promised to leave behind (its final checkpoint, its summary) could
    not be written: a full disk, a file system gone read-only. Not a mistake in the input."""

    exit_code = 1


class Preempted(DtlabError):
    """Training stopped on a signal after saving a checkpoint; the same command resumes it."""

    exit_code = 75  # EX_TEMPFAIL from sysexits.h: temporary failure, try again
