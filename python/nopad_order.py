"""nopad's training batch order, reproduced in plain Python (no dependencies).

Computes the global sample ids of every training step exactly as `nopad train` draws them: the generator of
src/core/rng.h (SplitMix64 key mixing, xoshiro256**, Lemire's unbiased uniform_int, Fisher-Yates from the back)
and EpochSampler of src/data/loader.cpp (one permutation per epoch keyed by {seed, "epoch", epoch}; a global batch is
the next `global_batch` ids; an epoch's tail shorter than a batch is dropped). Ids number the samples of a dataset
folder in shard-name order (nopad_shards.Dataset.sample(i) reads sample i).

    import nopad_order
    sampler = nopad_order.EpochSampler(dataset_size, seed=12345)
    cursor = nopad_order.Cursor()
    ids = sampler.next_global_batch(cursor, 256)      # list of ints; cursor advances (epoch, position)

Contract: all arithmetic is on unsigned 64-bit values (Python ints masked to 64 bits), so a seed given as a
negative number is taken modulo 2**64, as nopad's static_cast<uint64_t> does. tests/python/test_batch_order.py
checks the result against nopad's own loader (`nopad bench loader --dump-ids`).
"""

MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
EPOCH_TAG = 0x65706F6368  # "epoch": the purpose word of the shuffle key in EpochSampler::ensure_epoch
PARAM_TAG = 0x706172616D  # "param": the key of parameter initialisation (model/params.cpp), for reference


def splitmix64(state):
    """One SplitMix64 draw: returns (new_state, output)."""
    state = (state + _GOLDEN) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)


def mix_key(parts):
    """nopad::mix_key: several integers folded into one 64-bit key."""
    state = 0x6E6F706164  # "nopad"
    h = 0
    for p in parts:
        state ^= (p + _GOLDEN + (h << 6) + (h >> 2)) & MASK64
        state, h = splitmix64(state)
    return h


def _rotl(x, k):
    return ((x << k) | (x >> (64 - k))) & MASK64


class Rng:
    """xoshiro256** seeded through SplitMix64, as nopad::Rng. Rng(seed) or Rng([key parts])."""

    def __init__(self, seed_or_key):
        seed = mix_key([p & MASK64 for p in seed_or_key]) if isinstance(seed_or_key, (list, tuple)) else seed_or_key
        s = seed & MASK64
        self.s = []
        for _ in range(4):
            s, x = splitmix64(s)
            self.s.append(x)

    def next_u64(self):
        s0, s1, s2, s3 = self.s
        result = (_rotl((s1 * 5) & MASK64, 7) * 9) & MASK64
        t = (s1 << 17) & MASK64
        s2 ^= s0
        s3 ^= s1
        s1 ^= s2
        s0 ^= s3
        s2 ^= t
        s3 = _rotl(s3, 45)
        self.s = [s0, s1, s2, s3]
        return result

    def uniform(self):
        return (self.next_u64() >> 11) * (1.0 / (1 << 53))

    def uniform_int(self, lo, hi):
        """Uniform in [lo, hi] inclusive, Lemire's method with the same rejection rule (so the same draws)."""
        rng = (hi - lo + 1) & MASK64
        if rng == 0:
            x = self.next_u64()
            return x - (1 << 64) if x >> 63 else x
        m = self.next_u64() * rng
        low = m & MASK64
        if low < rng:
            threshold = ((1 << 64) - rng) % rng
            while low < threshold:
                m = self.next_u64() * rng
                low = m & MASK64
        return lo + (m >> 64)

    def shuffle(self, items):
        """In-place Fisher-Yates from the back, as Rng::shuffle."""
        for i in range(len(items) - 1, 0, -1):
            j = self.uniform_int(0, i)
            items[i], items[j] = items[j], items[i]


def epoch_permutation(dataset_size, seed, epoch, shuffle=True):
    """The order of epoch `epoch`: a list of the ids 0..dataset_size-1."""
    perm = list(range(dataset_size))
    if shuffle:
        Rng([seed, EPOCH_TAG, epoch]).shuffle(perm)
    return perm


class Cursor:
    """Where the next global batch starts: (epoch, samples of that epoch's permutation already used)."""

    def __init__(self, epoch=0, position=0):
        self.epoch, self.position = epoch, position

    def __eq__(self, other):
        return (self.epoch, self.position) == (other.epoch, other.position)

    def __repr__(self):
        return f"Cursor(epoch={self.epoch}, position={self.position})"


class EpochSampler:
    """nopad::EpochSampler: global batches from per-epoch permutations (the last permutation is cached)."""

    def __init__(self, dataset_size, seed, shuffle=True):
        self.size, self.seed, self.shuffle = dataset_size, seed, shuffle
        self._epoch, self._perm = None, None

    def permutation(self, epoch):
        if epoch != self._epoch:
            self._perm = epoch_permutation(self.size, self.seed, epoch, self.shuffle)
            self._epoch = epoch
        return self._perm

    def next_global_batch(self, cursor, global_batch):
        if not 1 <= global_batch <= self.size:
            raise ValueError(f"global batch of {global_batch} sequences does not fit a dataset of {self.size} "
                             "sequences")
        if cursor.position + global_batch > self.size:  # drop the epoch's short tail
            cursor.epoch += 1
            cursor.position = 0
        perm = self.permutation(cursor.epoch)
        ids = perm[cursor.position:cursor.position + global_batch]
        cursor.position += global_batch
        return ids


def global_batches(dataset_size, seed, global_batch, steps, start=None, shuffle=True):
    """The ids of `steps` consecutive global batches from `start` (default: the beginning), as a list of lists."""
    sampler = EpochSampler(dataset_size, seed, shuffle)
    cursor = start if start is not None else Cursor()
    return [sampler.next_global_batch(cursor, global_batch) for _ in range(steps)]


if __name__ == "__main__":
    import sys
    if len(sys.argv) != 5:
        sys.exit("usage: python3 nopad_order.py DATASET_SIZE SEED GLOBAL_BATCH STEPS   (prints one batch per line)")
    n, seed, batch, steps = (int(a) for a in sys.argv[1:])
    for ids in global_batches(n, seed, batch, steps):
        print(" ".join(map(str, ids)))
