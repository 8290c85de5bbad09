// Many LoRA adapters in one CPU step: y[row] += (x[row] A_slot^T) B_slot^T for rows of several adapters.
//
// Built and loaded by workers/lora_kernel.py (why it is hand-written is said there). Layout: A^T [S, in, R] and
// B^T [S, R, out], contiguous, R a multiple of 16 (workers.lora.Stack); the rows listed slot by slot (`order`,
// `starts` [S + 1]); `bounds` [S, R, 2] the columns [o0, o1) of B^T[s, k] that may be non-zero, multiples of 16
// or `out` (the fused q/k/v and gate/up B^T are block-diagonal; a rank past the adapter's own is [0, 0)).
//
// Every output element is summed by one thread in one fixed order (over `in` for t = x A^T, then over k for
// t B^T), so a row's result does not depend on the other rows, the threads or the vector width. Like two
// `F.linear` calls in the tensors' dtype, t is rounded to the dtype before its second product and the delta
// before it is added to y. Sixteen lanes and up to four rows are held in registers (GCC vector extensions:
// one zmm with AVX-512, two ymm with AVX2).
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

typedef float f16x __attribute__((vector_size(64)));
typedef uint16_t u16x __attribute__((vector_size(32)));
typedef uint32_t u32x __attribute__((vector_size(64)));

inline float load(const float v) { return v; }
inline float load(const uint16_t v) {
    uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline f16x load16(const float* p) {
    f16x v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
inline f16x load16(const uint16_t* p) {
    u16x h;
    std::memcpy(&h, p, sizeof h);
    u32x w = __builtin_convertvector(h, u32x) << 16;
    f16x v;
    std::memcpy(&v, &w, sizeof v);
    return v;
}

template <typename T> T store(float f);
template <> inline float store<float>(float f) { return f; }
template <> inline uint16_t store<uint16_t>(float f) {  // round to nearest even, as torch's bfloat16
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

constexpr int64_t kLanes = 16;
constexpr int64_t kRows = 4;       // rows of one slot held in registers at once
constexpr int64_t kColumns = 64;   // output columns a task of the second product owns (kColumns / kLanes vectors)
#ifdef __AVX512F__
constexpr int64_t kChunks = 4;     // 16-lane chunks of the rank a task of the first product holds (4 x 4 zmm)
#else
constexpr int64_t kChunks = 2;     // two ymm a chunk: 4 x 2 x 2 of AVX2's 16
#endif

// t[j, k0 : k0 + 16 C] for N rows of one slot: x rows gathered to float in xf [N, in]
template <typename T, int N, int C>
void first(const float* xf, int64_t in, const T* as, int64_t rank, int64_t k0, float* t) {
    f16x acc[N][C] = {};
    for (int64_t i = 0; i < in; ++i) {
        f16x a[C];
        for (int c = 0; c < C; ++c) a[c] = load16(as + i * rank + k0 + c * kLanes);
        for (int r = 0; r < N; ++r) {
            const float xi = xf[r * in + i];
            for (int c = 0; c < C; ++c) acc[r][c] += xi * a[c];
        }
    }
    for (int r = 0; r < N; ++r)
        for (int c = 0; c < C; ++c)
            for (int64_t l = 0; l < kLanes; ++l) t[r * rank + k0 + c * kLanes + l] = load(store<T>(acc[r][c][l]));
}

// y[j, c : c + 16 W] += t[j] B^T[:, c : c + 16 W] for N rows of one slot; a rank whose bounds cover only part
// of the W vectors (none in the fused layouts of the usual widths) adds to those alone, in the same order
template <typename T, int N, int W>
void second(const float* t, int64_t rank, const T* bs, const int32_t* bs_bounds, int64_t out, int64_t c, T* const* y) {
    f16x acc[N][W] = {};
    for (int64_t k = 0; k < rank; ++k) {
        const int64_t o0 = bs_bounds[2 * k], o1 = bs_bounds[2 * k + 1];
        if (o1 <= c || o0 >= c + W * kLanes) continue;
        const T* bk = bs + k * out + c;
        if (o0 <= c && c + W * kLanes <= o1) {
            f16x b[W];
            for (int w = 0; w < W; ++w) b[w] = load16(bk + w * kLanes);
            for (int r = 0; r < N; ++r) {
                const float tk = t[r * rank + k];
                for (int w = 0; w < W; ++w) acc[r][w] += tk * b[w];
            }
        } else {
            for (int w = 0; w < W; ++w) {
                if (c + w * kLanes < o0 || c + w * kLanes >= o1) continue;
                const f16x b = load16(bk + w * kLanes);
                for (int r = 0; r < N; ++r) acc[r][w] += t[r * rank + k] * b;
            }
        }
    }
    for (int r = 0; r < N; ++r)
        for (int w = 0; w < W; ++w)
            for (int64_t l = 0; l < kLanes; ++l) {
                T& yo = y[r][c + w * kLanes + l];
                yo = store<T>(load(yo) + load(store<T>(acc[r][w][l])));
            }
}

// the same for the columns [c, c1) past the last whole 16 (out not a multiple of 16), one row
template <typename T>
void second_tail(const float* t, int64_t rank, const T* bs, const int32_t* bs_bounds, int64_t out, int64_t c, int64_t c1, T* yr) {
    for (int64_t o = c; o < c1; ++o) {
        float acc = 0.0f;
        for (int64_t k = 0; k < rank; ++k)
            if (o >= bs_bounds[2 * k] && o < bs_bounds[2 * k + 1]) acc += t[k] * load(bs[k * out + o]);
        yr[o] = store<T>(load(yr[o]) + load(store<T>(acc)));
    }
}

// compile-time N (rows, 1..kRows) and M (vectors, 1..4) from run-time ones
template <typename F>
void dispatch(int64_t n, int64_t m, F&& f) {
    auto rows = [&](auto nn) {
        switch (m) {
            case 1: f(nn, std::integral_constant<int, 1>{}); break;
            case 2: f(nn, std::integral_constant<int, 2>{}); break;
            case 3: f(nn, std::integral_constant<int, 3>{}); break;
            default: f(nn, std::integral_constant<int, 4>{}); break;
        }
    };
    switch (n) {
        case 1: rows(std::integral_constant<int, 1>{}); break;
        case 2: rows(std::integral_constant<int, 2>{}); break;
        case 3: rows(std::integral_constant<int, 3>{}); break;
        default: rows(std::integral_constant<int, 4>{}); break;
    }
}

template <typename T>
void add(T* y, int64_t y_stride, const T* x, int64_t x_stride, const int64_t* order, const int64_t* starts,
         int64_t slots, const T* at, const T* bt, const int32_t* bounds, int64_t in, int64_t rank, int64_t out,
         int threads) {
    const int64_t m = starts[slots];
    std::vector<float> t(static_cast<size_t>(m * rank));
    std::vector<int64_t> blocks;  // (slot, first row) of each block of up to kRows rows
    for (int64_t s = 0; s < slots; ++s)
        for (int64_t j = starts[s]; j < starts[s + 1]; j += kRows) blocks.push_back(s * (m + 1) + j);
    const int64_t nblocks = static_cast<int64_t>(blocks.size());
    const int64_t column_blocks = (out + kColumns - 1) / kColumns;
    const int64_t chunk_groups = (rank / kLanes + kChunks - 1) / kChunks;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> xf(static_cast<size_t>(kRows * in));
#pragma omp for schedule(static)
        for (int64_t task = 0; task < nblocks * chunk_groups; ++task) {
            const int64_t b = task / chunk_groups, k0 = (task % chunk_groups) * kChunks * kLanes;
            const int64_t s = blocks[b] / (m + 1), j0 = blocks[b] % (m + 1);
            const int64_t n = (starts[s + 1] - j0 < kRows) ? starts[s + 1] - j0 : kRows;
            const int64_t chunks = (rank - k0) / kLanes < kChunks ? (rank - k0) / kLanes : kChunks;
            for (int64_t r = 0; r < n; ++r)
                for (int64_t i = 0; i < in; ++i) xf[r * in + i] = load(x[order[j0 + r] * x_stride + i]);
            const T* as = at + s * in * rank;
            float* tj = &t[j0 * rank];
            dispatch(n, chunks, [&](auto nn, auto cc) {
                if constexpr (cc <= kChunks) first<T, nn, cc>(xf.data(), in, as, rank, k0, tj);
            });
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < nblocks * column_blocks; ++task) {
            const int64_t b = task / column_blocks, c0 = (task % column_blocks) * kColumns;
            const int64_t c1 = (c0 + kColumns < out) ? c0 + kColumns : out;
            const int64_t s = blocks[b] / (m + 1), j0 = blocks[b] % (m + 1);
            const int64_t n = (starts[s + 1] - j0 < kRows) ? starts[s + 1] - j0 : kRows;
            const T* bs = bt + s * rank * out;
            const int32_t* bs_bounds = bounds + s * rank * 2;
            const float* tj = &t[j0 * rank];
            T* rows[kRows];
            for (int64_t r = 0; r < n; ++r) rows[r] = y + order[j0 + r] * y_stride;
            const int64_t vectors = (c1 - c0) / kLanes;
            if (vectors > 0)
                dispatch(n, vectors, [&](auto nn, auto ww) { second<T, nn, ww>(tj, rank, bs, bs_bounds, out, c0, rows); });
            const int64_t c = c0 + vectors * kLanes;
            if (c < c1)
                for (int64_t r = 0; r < n; ++r) second_tail<T>(tj + r * rank, rank, bs, bs_bounds, out, c, c1, rows[r]);
        }
    }
}

}  // namespace

extern "C" {

void lora_add_bf16(uint16_t* y, int64_t y_stride, const uint16_t* x, int64_t x_stride, const int64_t* order,
                   const int64_t* starts, int64_t slots, const uint16_t* at, const uint16_t* bt,
                   const int32_t* bounds, int64_t in, int64_t rank, int64_t out, int threads) {
    add<uint16_t>(y, y_stride, x, x_stride, order, starts, slots, at, bt, bounds, in, rank, out, threads);
}

void lora_add_f32(float* y, int64_t y_stride, const float* x, int64_t x_stride, const int64_t* order,
                  const int64_t* starts, int64_t slots, const float* at, const float* bt, const int32_t* bounds,
                  int64_t in, int64_t rank, int64_t out, int threads) {
    add<float>(y, y_stride, x, x_stride, order, starts, slots, at, bt, bounds, in, rank, out, threads);
}

}
