// One token per row of a logits batch: greedy (temperature <= 0), or a draw from
// softmax(logits / temperature) restricted by top-k, top-p and min-p, by the Gumbel-max
// trick with a counter-based RNG. Reference: kernels.reference.sampling_survivors,
// sampling_probabilities and sample_tokens_reference (which reproduces the noise).
//
// Semantics (value thresholds; the same as the reference). With z = logits / T (an IEEE
// division, bitwise the reference's), m = max z and rel(z) = expf(z - m):
//   top-k: keep z >= the k-th largest z (all tokens tied with it too);
//   top-p: keep z when the mass of the tokens strictly more likely than z is < top_p;
//   min-p: keep rel(z) >= min_p; the tokens equal to m always survive; -inf never does.
// For distinct values this is exactly the sort-order rule of engine/sampling/sampler.py; the two
// differ only where equal values straddle a cut (we keep the whole tie group).
//
// Layout: one CTA of 1024 threads per row (grid = N), every pass a coalesced sweep of the
// row in 16-byte loads, three or four in flight per thread.
//   greedy row:      1 sweep  (argmax; lowest index among equal maxima, NaN counts as max).
//   no filter:       1 sweep  (Gumbel-max over every finite token).
//   min-p only:      2 sweeps (max; Gumbel-max over the min-p survivors).
//   top-k / top-p:   3 sweeps: (1) max and min of z; (2) a 4096-bucket histogram of
//                    count and mass over the window W (below); the bucket b* holding the
//                    cut is found by a block scan; (3) the Gumbel-max over the tokens of
//                    buckets above b* (all survivors), while the tokens of b* are copied to
//                    shared memory (at most 16384), sorted there (bitonic) and the exact cut
//                    is found by a scan. A bucket with more tokens (huge tie groups, very
//                    flat rows) falls back to a radix select over the exact float bits of z,
//                    8 bits a sweep, then one more sweep for the draw.
// The window W = {d = z - m >= -32 and (no min-p or expf(d) >= min_p)}: a token with
// d < -32 can never win the Gumbel-max (our Gumbel noise lies in [-3.2, 23]) so leaving it
// out changes no draw; it bounds the histogram's range and skips the tail cheaply.
//
// Determinism: masses are summed as 64-bit fixed point (2^-40 units) with integer atomics,
// counts as integers, candidates are sorted by (value, index): every decision is exact and
// independent of thread timing, so a row's token is a pure function of its logits, its
// parameters and (seed, offset).
//
// Noise: token i of a row draws r = word (i & 3) of Philox-4x32-10 with key (seed lo, seed
// hi) and counter (i >> 2, 0, offset lo, offset hi); u = (r + 1/2) / 2^32 in (0, 1);
// G = -log(-log(u)), with -log(u) computed as -log1p(-(1 - u)) for u >= 1/2 so the upper
// tail keeps its precision.

namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
// float4 loads in flight per thread in a sweep: 4 in the light ones (argmax, max), 3 where
// the body keeps more registers live (histogram, Philox): 4 there spills at the 64-register cap
// that 1024 threads per CTA impose.
constexpr int kUnrollLight = 4;
constexpr int kUnrollHeavy = 3;
constexpr int kBuckets = 4096;      // first-level histogram over the window
constexpr int kBucketsPerThread = kBuckets / kThreads;
constexpr int kCapacity = 16384;    // candidates sorted in shared memory (8 bytes each)
constexpr int kDigitBits = 8;       // radix digit of the fallback
constexpr int kDigits = 1 << kDigitBits;
constexpr float kWindow = 32.0f;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kNoIndex = 0x7fffffff;

static_assert(kWarps == 32, "block reductions assume 32 warps");
static_assert(kBuckets % kThreads == 0, "each thread scans whole buckets");

__device__ __forceinline__ float negative_infinity() { return __int_as_float(0xff800000); }

// Unsigned key with the order of the floats (-0 and +0 share one key).
__device__ __forceinline__ unsigned ordered_key(float x) {
    unsigned bits = __float_as_uint(x);
    if ((bits << 1) == 0u) bits = 0u;
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

__device__ __forceinline__ float key_value(unsigned key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// expf(d) in (0, 1] as an integer number of 2^-40: integer sums are exact and associative.
__device__ __forceinline__ unsigned long long fixed_mass(float e) {
    return __float2ull_rn(e * 1099511627776.0f);
}

__device__ __forceinline__ uint4 philox4x32_10(unsigned c0, unsigned c1, unsigned c2,
                                               unsigned c3, unsigned k0, unsigned k1) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        const unsigned lo0 = 0xD2511F53u * c0;
        const unsigned hi0 = __umulhi(0xD2511F53u, c0);
        const unsigned lo1 = 0xCD9E8D57u * c2;
        const unsigned hi1 = __umulhi(0xCD9E8D57u, c2);
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return make_uint4(c0, c1, c2, c3);
}

__device__ __forceinline__ unsigned pick_word(const uint4& r, int j) {
    return j == 0 ? r.x : (j == 1 ? r.y : (j == 2 ? r.z : r.w));
}

// Standard Gumbel noise from 32 random bits; never infinite (u is never 0 or 1).
__device__ __forceinline__ float gumbel(unsigned r) {
    float e;
    if (r < 0x80000000u) {
        e = -logf(fmaf(__uint2float_rn(r), 0x1p-32f, 0x1p-33f));
    } else {
        e = -log1pf(-fmaf(__uint2float_rn(~r), 0x1p-32f, 0x1p-33f));
    }
    return -logf(e);
}

struct Stream {
    unsigned k0, k1, c2, c3;

    __device__ __forceinline__ uint4 group(int first_token) const {
        return philox4x32_10(static_cast<unsigned>(first_token) >> 2, 0u, c2, c3, k0, k1);
    }
    __device__ __forceinline__ float noise(int token) const {
        return gumbel(pick_word(group(token), token & 3));
    }
};

struct Scratch {
    unsigned key[kWarps];
    unsigned key2[kWarps];
    int index[kWarps];
    unsigned long long mass[kWarps];
    float value[kWarps];
    float value2[kWarps];
    // Row state handed from one thread to all.
    int bucket;              // b*: first bucket (from the top) where a cut criterion is met
    int position;            // the cut's position among the sorted candidates
    unsigned candidates;     // slots taken in the candidate list
    unsigned bucket_count;   // tokens in b* (or in the chosen digit)
    unsigned count_above;    // window tokens above the current search range
    unsigned long long mass_above;
    unsigned digit;
};

// A (key, index) pair beats another on a larger key, or an equal key and a lower index.
__device__ __forceinline__ void keep_better(unsigned& key, int& index, unsigned other_key,
                                            int other_index) {
    if (other_key > key || (other_key == key && other_index < index)) {
        key = other_key;
        index = other_index;
    }
}

__device__ int block_argmax(unsigned key, int index, Scratch& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        keep_better(key, index, __shfl_xor_sync(kFull, key, o), __shfl_xor_sync(kFull, index, o));
    }
    if (lane == 0) {
        s.key[warp] = key;
        s.index[warp] = index;
    }
    __syncthreads();
    key = s.key[lane];
    index = s.index[lane];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        keep_better(key, index, __shfl_xor_sync(kFull, key, o), __shfl_xor_sync(kFull, index, o));
    }
    __syncthreads();
    return index;
}

__device__ void block_max_min(float& hi, float& lo, Scratch& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        hi = fmaxf(hi, __shfl_xor_sync(kFull, hi, o));
        lo = fminf(lo, __shfl_xor_sync(kFull, lo, o));
    }
    if (lane == 0) {
        s.value[warp] = hi;
        s.value2[warp] = lo;
    }
    __syncthreads();
    hi = s.value[lane];
    lo = s.value2[lane];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        hi = fmaxf(hi, __shfl_xor_sync(kFull, hi, o));
        lo = fminf(lo, __shfl_xor_sync(kFull, lo, o));
    }
    __syncthreads();
}

__device__ void block_min_max_key(unsigned& lo, unsigned& hi, Scratch& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        lo = min(lo, __shfl_xor_sync(kFull, lo, o));
        hi = max(hi, __shfl_xor_sync(kFull, hi, o));
    }
    if (lane == 0) {
        s.key[warp] = lo;
        s.key2[warp] = hi;
    }
    __syncthreads();
    lo = s.key[lane];
    hi = s.key2[lane];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        lo = min(lo, __shfl_xor_sync(kFull, lo, o));
        hi = max(hi, __shfl_xor_sync(kFull, hi, o));
    }
    __syncthreads();
}

__device__ unsigned long long block_sum(unsigned long long v, Scratch& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
    if (lane == 0) s.mass[warp] = v;
    __syncthreads();
    v = s.mass[lane];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
    __syncthreads();
    return v;
}

// Exclusive prefix over the threads in order of (count, mass); also returns the totals.
__device__ void block_exclusive_scan(unsigned& count, unsigned long long& mass,
                                     unsigned long long& total_mass, Scratch& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned c = count;
    unsigned long long m = mass;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned cu = __shfl_up_sync(kFull, c, o);
        const unsigned long long mu = __shfl_up_sync(kFull, m, o);
        if (lane >= o) {
            c += cu;
            m += mu;
        }
    }
    if (lane == 31) {
        s.key[warp] = c;
        s.mass[warp] = m;
    }
    __syncthreads();
    unsigned wc = s.key[lane];
    unsigned long long wm = s.mass[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned cu = __shfl_up_sync(kFull, wc, o);
        const unsigned long long mu = __shfl_up_sync(kFull, wm, o);
        if (lane >= o) {
            wc += cu;
            wm += mu;
        }
    }
    // wc, wm: inclusive totals of warps 0..lane; take warp - 1's and the last.
    const unsigned before_c = __shfl_sync(kFull, wc, (warp + 31) & 31);
    const unsigned long long before_m = __shfl_sync(kFull, wm, (warp + 31) & 31);
    total_mass = __shfl_sync(kFull, wm, 31);
    count = (warp ? before_c : 0u) + c - count;
    mass = (warp ? before_m : 0ull) + m - mass;
    __syncthreads();
}

// Calls f(first_token, v) for each group of 4 consecutive tokens of the row, v[j] being
// token first_token + j (-inf past the end). Every thread runs the same number of calls, so
// f may use warp votes. vec: the row is 16-byte aligned with vocab % 4 == 0.
template <int kUnroll, typename F>
__device__ __forceinline__ void for_each_group(const float* __restrict__ row, int vocab,
                                               bool vec, F&& f) {
    const int groups = (vocab + 3) >> 2;
    for (int base = 0; base < groups; base += kThreads * kUnroll) {
        float v[kUnroll][4];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int g = base + u * kThreads + static_cast<int>(threadIdx.x);
            if (vec && g < groups) {
                const float4 q = __ldg(reinterpret_cast<const float4*>(row) + g);
                v[u][0] = q.x;
                v[u][1] = q.y;
                v[u][2] = q.z;
                v[u][3] = q.w;
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int t = 4 * g + j;
                    v[u][j] = (g < groups && t < vocab) ? __ldg(row + t) : negative_infinity();
                }
            }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            f(4 * (base + u * kThreads + static_cast<int>(threadIdx.x)), v[u]);
        }
    }
}

// The row's filters, after pass 1.
struct Row {
    float temperature;
    float top;        // m = max z
    float prefilter;  // d below this is outside the window (cheap test before expf)
    float scale;      // buckets per unit of d
    float min_p;
    bool use_min_p;
    bool use_k;
    bool use_p;
    unsigned k;
    unsigned long long target_mass;  // ceil(top_p * window mass), fixed point

    // Whether z is in the window W (expf only where min-p needs it).
    __device__ __forceinline__ bool in_window(float z) const {
        const float d = z - top;
        if (!(d >= prefilter)) return false;
        return d >= -kWindow && (!use_min_p || expf(d) >= min_p);
    }
    // Non-increasing in z: bucket 0 holds the largest values.
    __device__ __forceinline__ int bucket(float z) const {
        const float f = (top - z) * scale;
        return f < static_cast<float>(kBuckets - 1) ? static_cast<int>(f) : kBuckets - 1;
    }
    __device__ __forceinline__ bool crossed(unsigned count, unsigned long long mass) const {
        return (use_k && count >= k) || (use_p && mass >= target_mass);
    }
};

// The candidate list: 64-bit (ordered key of z) << 32 | ~token, sorted descending, so ties
// sort by increasing token and the order is independent of the order of insertion.
__device__ __forceinline__ unsigned long long pack(float z, int token) {
    return (static_cast<unsigned long long>(ordered_key(z)) << 32) |
           static_cast<unsigned>(~token);
}

__device__ __forceinline__ void append_candidate(bool want, unsigned long long entry,
                                                 unsigned long long* list, Scratch& s) {
    const unsigned mask = __ballot_sync(kFull, want);
    if (mask == 0u) return;
    const int lane = threadIdx.x & 31;
    const int leader = __ffs(mask) - 1;
    unsigned base = 0;
    if (lane == leader) base = atomicAdd(&s.candidates, static_cast<unsigned>(__popc(mask)));
    base = __shfl_sync(kFull, base, leader);
    if (want) {
        const unsigned slot = base + __popc(mask & ((1u << lane) - 1u));
        if (slot < static_cast<unsigned>(kCapacity)) list[slot] = entry;
    }
}

__device__ void bitonic_sort_descending(unsigned long long* a, unsigned n2) {
    for (unsigned size = 2; size <= n2; size <<= 1) {
        for (unsigned stride = size >> 1; stride > 0; stride >>= 1) {
            for (unsigned i = threadIdx.x; i < n2 / 2; i += kThreads) {
                const unsigned lo = 2 * i - (i & (stride - 1));
                const unsigned hi = lo + stride;
                const bool descending = (lo & size) == 0;
                const unsigned long long x = a[lo], y = a[hi];
                if ((x < y) == descending) {
                    a[lo] = y;
                    a[hi] = x;
                }
            }
            __syncthreads();
        }
    }
}

// Sorts the n candidates (all of one search range, below count_above tokens of mass
// mass_above) and returns the cut value t: survivors are the window tokens with z >= t.
__device__ float select_cut(unsigned long long* list, unsigned n, unsigned count_above,
                            unsigned long long mass_above, const Row& row, Scratch& s) {
    unsigned n2 = 1;
    while (n2 < n) n2 <<= 1;
    for (unsigned i = n + threadIdx.x; i < n2; i += kThreads) list[i] = 0ull;  // sorts last
    if (threadIdx.x == 0) s.position = kNoIndex;
    __syncthreads();
    bitonic_sort_descending(list, n2);

    // Each thread takes a run of consecutive sorted entries; a scan gives the mass before it.
    const unsigned per = (n2 + kThreads - 1) / kThreads;
    const unsigned begin = min(threadIdx.x * per, n);
    const unsigned end = min(begin + per, n);
    unsigned count = end - begin;
    unsigned long long mass = 0;
    if (row.use_p) {
        for (unsigned j = begin; j < end; ++j) {
            mass += fixed_mass(expf(key_value(static_cast<unsigned>(list[j] >> 32)) - row.top));
        }
    }
    unsigned long long total;
    block_exclusive_scan(count, mass, total, s);
    unsigned c = count_above + count;
    unsigned long long m = mass_above + mass;
    for (unsigned j = begin; j < end; ++j) {
        c += 1;
        if (row.use_p) {
            m += fixed_mass(expf(key_value(static_cast<unsigned>(list[j] >> 32)) - row.top));
        }
        if (row.crossed(c, m)) {
            atomicMin(&s.position, static_cast<int>(j));
            break;
        }
    }
    __syncthreads();
    // The histogram guarantees a crossing in this range; n - 1 only guards the impossible.
    const int position = s.position == kNoIndex ? static_cast<int>(n) - 1 : s.position;
    return key_value(static_cast<unsigned>(list[position] >> 32));
}

// The Gumbel-max over the window tokens with z >= cut (all finite tokens when !windowed);
// returns this thread's best (key of z + G, token).
__device__ __forceinline__ void draw_sweep(const float* __restrict__ x, int vocab, bool vec,
                                           const Row& row, const Stream& stream, bool windowed,
                                           float cut, unsigned& best_key, int& best_token) {
    for_each_group<kUnrollHeavy>(x, vocab, vec, [&](int first, const float(&v)[4]) {
        uint4 rnd = make_uint4(0u, 0u, 0u, 0u);
        bool have = false;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float z = v[j] / row.temperature;
            const bool keep = windowed ? (row.in_window(z) && z >= cut)
                                       : (z > negative_infinity());
            if (keep) {
                if (!have) {
                    rnd = stream.group(first);
                    have = true;
                }
                keep_better(best_key, best_token, ordered_key(z + gumbel(pick_word(rnd, j))),
                            first + j);
            }
        }
    });
}

__device__ int greedy_row(const float* __restrict__ x, int vocab, bool vec, Scratch& s) {
    unsigned best_key = 0u;
    int best_token = kNoIndex;
    for_each_group<kUnrollLight>(x, vocab, vec, [&](int first, const float(&v)[4]) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            // torch.argmax counts NaN as the largest value.
            const unsigned key = v[j] != v[j] ? 0xffffffffu : ordered_key(v[j]);
            keep_better(best_key, best_token, key, first + j);
        }
    });
    return block_argmax(best_key, best_token, s);
}

__device__ int sampled_row(const float* __restrict__ x, int vocab, bool vec, float temperature,
                           int top_k, float top_p, float min_p, const Stream& stream,
                           unsigned long long* shared, Scratch& s) {
    Row row;
    row.temperature = temperature;
    row.use_k = top_k > 0 && top_k < vocab;
    row.k = static_cast<unsigned>(top_k);
    row.use_p = top_p < 1.0f;
    row.use_min_p = min_p > 0.0f;
    row.min_p = fminf(min_p, 1.0f);  // the maximum (rel = 1) always survives
    unsigned best_key = 0u;
    int best_token = kNoIndex;

    if (!row.use_k && !row.use_p && !row.use_min_p) {
        draw_sweep(x, vocab, vec, row, stream, false, 0.0f, best_key, best_token);
        return block_argmax(best_key, best_token, s);
    }

    // Pass 1: m and the smallest finite z (it narrows the histogram's range). A rounded
    // division is monotone in x, so max(x / T) = max(x) / T exactly: no division per token.
    float hi = negative_infinity(), lo = -negative_infinity();
    for_each_group<kUnrollLight>(x, vocab, vec, [&](int, const float(&v)[4]) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            hi = fmaxf(hi, v[j]);
            if (v[j] > negative_infinity()) lo = fminf(lo, v[j]);
        }
    });
    block_max_min(hi, lo, s);
    row.top = hi / temperature;
    float floor_d = fmaxf(-kWindow, lo / temperature - row.top);
    row.prefilter = -kWindow;
    if (row.use_min_p) {
        // expf(d) >= min_p is impossible below log(min_p) - 0.01 (expf, logf err < 1e-6).
        const float log_min_p = logf(row.min_p);
        floor_d = fmaxf(floor_d, log_min_p);
        row.prefilter = fmaxf(-kWindow, log_min_p - 0.01f);
    }
    row.scale = static_cast<float>(kBuckets) / fmaxf(-floor_d, 1e-6f);
    row.target_mass = 0ull;

    float cut = negative_infinity();
    if (row.use_k || row.use_p) {
        // Pass 2: count and mass of the window tokens per bucket.
        unsigned long long* bucket_mass = shared;
        unsigned* bucket_count = reinterpret_cast<unsigned*>(shared + kBuckets);
        for (int i = threadIdx.x; i < kBuckets; i += kThreads) {
            bucket_mass[i] = 0ull;
            bucket_count[i] = 0u;
        }
        if (threadIdx.x == 0) s.bucket = kBuckets;
        __syncthreads();
        // top-p's mass is a fraction of the whole softmax, min-p's cut tokens included (those
        // below the window weigh < 2^-40 each relative to the max: 0 in fixed point anyway).
        unsigned long long all_mass = 0ull;
        const float floor_all = row.use_p ? -kWindow : row.prefilter;
        for_each_group<kUnrollHeavy>(x, vocab, vec, [&](int, const float(&v)[4]) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float z = v[j] / temperature;
                const float d = z - row.top;
                if (d >= floor_all) {
                    // The window test of Row::in_window, spelled out to share expf(d).
                    const float e = expf(d);
                    const unsigned long long mass = fixed_mass(e);
                    all_mass += mass;
                    if (d >= -kWindow && (!row.use_min_p || e >= row.min_p)) {
                        const int b = row.bucket(z);
                        atomicAdd(bucket_count + b, 1u);
                        if (row.use_p) atomicAdd(bucket_mass + b, mass);
                    }
                }
            }
        });
        __syncthreads();
        if (row.use_p) all_mass = block_sum(all_mass, s);

        // Block scan over the buckets from the top; b* = the first that meets a criterion.
        const int first = threadIdx.x * kBucketsPerThread;
        unsigned c[kBucketsPerThread];
        unsigned long long w[kBucketsPerThread];
        unsigned count = 0;
        unsigned long long mass = 0;
#pragma unroll
        for (int i = 0; i < kBucketsPerThread; ++i) {
            c[i] = bucket_count[first + i];
            w[i] = bucket_mass[first + i];
            count += c[i];
            mass += w[i];
        }
        unsigned long long window_mass;
        block_exclusive_scan(count, mass, window_mass, s);
        if (row.use_p) {
            const double target = static_cast<double>(top_p) * static_cast<double>(all_mass);
            row.target_mass = target > 0.0 ? static_cast<unsigned long long>(ceil(target)) : 0ull;
        }
        {
            unsigned cc = count;
            unsigned long long mm = mass;
#pragma unroll
            for (int i = 0; i < kBucketsPerThread; ++i) {
                cc += c[i];
                mm += w[i];
                if (c[i] != 0u && row.crossed(cc, mm)) {
                    atomicMin(&s.bucket, first + i);
                    break;
                }
            }
        }
        __syncthreads();
        const int bstar = s.bucket;
        if (bstar < kBuckets && bstar >= first && bstar < first + kBucketsPerThread) {
            unsigned cc = count;
            unsigned long long mm = mass;
#pragma unroll
            for (int i = 0; i < kBucketsPerThread; ++i) {
                if (first + i == bstar) {
                    s.count_above = cc;
                    s.mass_above = mm;
                    s.bucket_count = c[i];
                }
                cc += c[i];
                mm += w[i];
            }
        }
        if (threadIdx.x == 0) s.candidates = 0u;
        __syncthreads();  // the histogram is dead from here: its memory holds candidates

        if (bstar < kBuckets) {
            unsigned count_above = s.count_above;
            unsigned long long mass_above = s.mass_above;
            unsigned long long* list = shared;
            if (s.bucket_count <= static_cast<unsigned>(kCapacity)) {
                // Pass 3: draw over the buckets above b*, collect b*'s tokens.
                for_each_group<kUnrollHeavy>(x, vocab, vec, [&](int first_token, const float(&v)[4]) {
                    uint4 rnd = make_uint4(0u, 0u, 0u, 0u);
                    bool have = false;
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const float z = v[j] / temperature;
                        const int b = row.in_window(z) ? row.bucket(z) : kBuckets;
                        if (b < bstar) {
                            if (!have) {
                                rnd = stream.group(first_token);
                                have = true;
                            }
                            keep_better(best_key, best_token,
                                        ordered_key(z + gumbel(pick_word(rnd, j))),
                                        first_token + j);
                        }
                        append_candidate(b == bstar, pack(z, first_token + j), list, s);
                    }
                });
                __syncthreads();
                const unsigned n = min(s.candidates, static_cast<unsigned>(kCapacity));
                cut = select_cut(list, n, count_above, mass_above, row, s);
                for (unsigned j = threadIdx.x; j < n; j += kThreads) {
                    const unsigned long long entry = list[j];
                    const float z = key_value(static_cast<unsigned>(entry >> 32));
                    if (z >= cut) {
                        const int token = static_cast<int>(~static_cast<unsigned>(entry));
                        keep_better(best_key, best_token, ordered_key(z + stream.noise(token)),
                                    token);
                    }
                }
                return block_argmax(best_key, best_token, s);
            }

            // Fallback: b* is too big for shared memory. Radix select over the exact bits of
            // z inside b*, starting below the bits all its keys share.
            unsigned key_lo = 0xffffffffu, key_hi = 0u;
            for_each_group<kUnrollHeavy>(x, vocab, vec, [&](int, const float(&v)[4]) {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const float z = v[j] / temperature;
                    if (row.in_window(z) && row.bucket(z) == bstar) {
                        const unsigned key = ordered_key(z);
                        key_lo = min(key_lo, key);
                        key_hi = max(key_hi, key);
                    }
                }
            });
            block_min_max_key(key_lo, key_hi, s);
            if (key_lo == key_hi) {
                cut = key_value(key_lo);  // one tie group: the cut is its value
            } else {
                int bits = 32 - __clz(key_lo ^ key_hi);
                unsigned long long prefix = static_cast<unsigned long long>(key_lo) >> bits;
                unsigned long long* digit_mass = shared;
                unsigned* digit_count = reinterpret_cast<unsigned*>(shared + kDigits);
                while (true) {
                    const int width = bits < kDigitBits ? bits : kDigitBits;
                    const int shift = bits - width;
                    const unsigned digits = 1u << width;
                    for (int i = threadIdx.x; i < kDigits; i += kThreads) {
                        digit_mass[i] = 0ull;
                        digit_count[i] = 0u;
                    }
                    __syncthreads();
                    for_each_group<kUnrollHeavy>(x, vocab, vec, [&](int, const float(&v)[4]) {
#pragma unroll
                        for (int j = 0; j < 4; ++j) {
                            const float z = v[j] / temperature;
                            if (row.in_window(z) && row.bucket(z) == bstar) {
                                const unsigned key = ordered_key(z);
                                if ((static_cast<unsigned long long>(key) >> bits) == prefix) {
                                    const unsigned d = (key >> shift) & (digits - 1u);
                                    atomicAdd(digit_count + d, 1u);
                                    if (row.use_p) {
                                        atomicAdd(digit_mass + d, fixed_mass(expf(z - row.top)));
                                    }
                                }
                            }
                        }
                    });
                    __syncthreads();
                    if (threadIdx.x == 0) {
                        unsigned cc = count_above;
                        unsigned long long mm = mass_above;
                        int chosen = -1;
                        unsigned chosen_c = cc;
                        unsigned long long chosen_m = mm;
                        for (int d = static_cast<int>(digits) - 1; d >= 0; --d) {
                            if (digit_count[d] == 0u) continue;
                            chosen = d;
                            chosen_c = cc;
                            chosen_m = mm;
                            cc += digit_count[d];
                            mm += digit_mass[d];
                            if (row.crossed(cc, mm)) break;
                        }
                        // (the loop always finds a crossing; else the lowest non-empty digit)
                        s.digit = static_cast<unsigned>(chosen);
                        s.count_above = chosen_c;
                        s.mass_above = chosen_m;
                        s.bucket_count = digit_count[chosen];
                        s.candidates = 0u;
                    }
                    __syncthreads();
                    count_above = s.count_above;
                    mass_above = s.mass_above;
                    prefix = (prefix << width) | s.digit;
                    bits = shift;
                    const unsigned in_digit = s.bucket_count;
                    if (bits == 0) {
                        cut = key_value(static_cast<unsigned>(prefix));
                        break;
                    }
                    if (in_digit <= static_cast<unsigned>(kCapacity)) {
                        __syncthreads();  // every thread has read s before the list reuses shared
                        for_each_group<kUnrollHeavy>(x, vocab, vec, [&](int first_token, const float(&v)[4]) {
#pragma unroll
                            for (int j = 0; j < 4; ++j) {
                                const float z = v[j] / temperature;
                                const bool want =
                                    row.in_window(z) && row.bucket(z) == bstar &&
                                    (static_cast<unsigned long long>(ordered_key(z)) >> bits) ==
                                        prefix;
                                append_candidate(want, pack(z, first_token + j), list, s);
                            }
                        });
                        __syncthreads();
                        const unsigned n = min(s.candidates, static_cast<unsigned>(kCapacity));
                        cut = select_cut(list, n, count_above, mass_above, row, s);
                        break;
                    }
                }
            }
        }
    }
    // Min-p only, no cut in the window, or after the fallback: draw over W ∩ {z >= cut}.
    draw_sweep(x, vocab, vec, row, stream, true, cut, best_key, best_token);
    return block_argmax(best_key, best_token, s);
}

}  // namespace

// grid: (N); block: 1024 threads; dynamic shared memory: 131072 bytes.
// out int64 [N]; logits float32 [N, vocab]; temperature, top_p, min_p float32 [N];
// top_k int32 [N]; seeds, offsets int64 [N].
extern "C" __global__ void __launch_bounds__(kThreads, 1)
    sample_tokens_f32(long long* __restrict__ out, const float* __restrict__ logits,
                      const float* __restrict__ temperature, const int* __restrict__ top_k,
                      const float* __restrict__ top_p, const float* __restrict__ min_p,
                      const long long* __restrict__ seeds, const long long* __restrict__ offsets,
                      int vocab) {
    extern __shared__ unsigned long long shared[];
    __shared__ Scratch s;
    const int r = blockIdx.x;
    const float* x = logits + static_cast<unsigned long long>(r) * vocab;
    const bool vec = (vocab & 3) == 0 && (reinterpret_cast<unsigned long long>(logits) & 15) == 0;
    const float t = temperature[r];
    int token;
    if (!(t > 0.0f)) {
        token = greedy_row(x, vocab, vec, s);
    } else {
        const unsigned long long seed = static_cast<unsigned long long>(seeds[r]);
        const unsigned long long offset = static_cast<unsigned long long>(offsets[r]);
        Stream stream;
        stream.k0 = static_cast<unsigned>(seed);
        stream.k1 = static_cast<unsigned>(seed >> 32);
        stream.c2 = static_cast<unsigned>(offset);
        stream.c3 = static_cast<unsigned>(offset >> 32);
        token = sampled_row(x, vocab, vec, t, top_k[r], top_p[r], min_p[r], stream, shared, s);
    }
    if (threadIdx.x == 0) out[r] = token == kNoIndex ? 0 : token;
}
