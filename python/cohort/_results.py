"""What a run returns: plain Python objects, with pandas frames on request."""

from dataclasses import dataclass, field


class Rows(list):
    """A list of row dicts (one per round, or per client and round), with
    the columns of ``results.csv`` / ``clients.csv``."""

    def to_pandas(self):
        """The rows as a ``pandas.DataFrame`` (needs pandas installed)."""
        try:
            import pandas
        except ImportError as error:
            raise ImportError("to_pandas() needs pandas: pip install pandas") from error
        return pandas.DataFrame(list(self))


@dataclass
class RunResult:
    """A finished run: its folder, every round's row, every client's row
    (dropped clients' included, with ``dropped`` saying why) and the final
    model as a dict of NumPy arrays in PyTorch's ``state_dict`` layout
    (named ``"0"``, ``"1"``, ... for ``cohort.simulate``, and in a list as
    ``parameters``)."""

    run_dir: str
    model_path: str
    reached_target: bool
    rounds: Rows = field(default_factory=Rows)
    clients: Rows = field(default_factory=Rows)
    model: dict = field(default_factory=dict)
    #: ``cohort.simulate``: the final model as a list of arrays, in the
    #: order of the clients' parameters (empty for ``cohort.run``).
    parameters: list = field(default_factory=list)

    def to_pandas(self):
        """The rounds as a ``pandas.DataFrame`` (``clients.to_pandas()`` for
        the clients' rows)."""
        return self.rounds.to_pandas()
