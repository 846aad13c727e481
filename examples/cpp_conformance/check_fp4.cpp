// check_fp4: a dependency-free C++17 consumer of qcore's conformance vectors.
//
// It plays the part of a kernel test suite with no Python: it reads manifest.tsv and the raw .bin files that
// `qcore conformance export` wrote, runs a small reference implementation of two kernels under test
//
//   * float4_e2m1fn cast (round-half-even, saturating at +-6, -0 kept), op "cast";
//   * MXFP4 quantize (E8M0 scale per block of 32 along the last axis, scale rule FLOOR/CEIL/EVEN/RCEIL,
//     fp4 elements, NaN/Inf block -> NaN scale 0xFF, codes 0, NaN values), op "quantize",
//
// writes what the kernel produced to OUTPUT_DIR/<case>/<role>.bin (the names `qcore conformance check` looks
// for), and compares itself with the expected .bin files byte for byte, printing the first mismatches.
//
// Build and run:
//     g++ -std=c++17 -O2 -o check_fp4 check_fp4.cpp          (or: make)
//     python -m qcore conformance export vectors --formats float4_e2m1fn,mxfp4
//     ./check_fp4 vectors out                                 (exit 0: all equal, 1: mismatches, 2: errors)
//     python -m qcore conformance check vectors --outputs out --formats float4_e2m1fn,mxfp4
//
// --ties-away makes the "kernel" round ties away from zero (microxcaling's fp4 rounding: 2.5 -> 3): a seeded
// bug that both this program and `qcore conformance check` must catch.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

struct Entry {  // one line of manifest.tsv
    std::string kase, role, dtype, shape, file, format, op, mode;
    int block_size = 0;
    std::vector<long> dims;
    long count() const {
        long n = 1;
        for (long d : dims) n *= d;
        return n;
    }
};

static std::vector<long> parse_shape(const std::string& s) {
    std::vector<long> dims;
    if (s == "scalar") return dims;
    std::stringstream ss(s);
    std::string tok;
    while (std::getline(ss, tok, 'x')) dims.push_back(std::stol(tok));
    return dims;
}

static std::vector<Entry> read_manifest(const fs::path& dir) {
    std::ifstream in(dir / "manifest.tsv");
    if (!in) throw std::runtime_error("cannot open " + (dir / "manifest.tsv").string());
    std::vector<Entry> out;
    std::string line;
    while (std::getline(in, line)) {
        if (line.empty() || line[0] == '#') continue;
        std::istringstream ls(line);
        Entry e;
        ls >> e.kase >> e.role >> e.dtype >> e.shape >> e.file >> e.format >> e.op >> e.mode >> e.block_size;
        if (!ls) throw std::runtime_error("bad manifest.tsv line: " + line);
        e.dims = parse_shape(e.shape);
        out.push_back(e);
    }
    return out;
}

static size_t itemsize(const std::string& dtype) {
    if (dtype == "float32" || dtype == "int32" || dtype == "uint32") return 4;
    if (dtype == "uint8" || dtype == "int8") return 1;
    if (dtype == "int16" || dtype == "uint16") return 2;
    throw std::runtime_error("unsupported dtype " + dtype);
}

static std::vector<uint8_t> read_bytes(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    if (!in) throw std::runtime_error("cannot open " + p.string());
    return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

static void write_bytes(const fs::path& p, const void* data, size_t n) {
    fs::create_directories(p.parent_path());
    std::ofstream out(p, std::ios::binary);
    out.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
    if (!out) throw std::runtime_error("cannot write " + p.string());
}

// The .bin files are little-endian; this program assumes a little-endian host (x86, ARM, GPUs' hosts).
static std::vector<float> as_floats(const std::vector<uint8_t>& b) {
    std::vector<float> v(b.size() / 4);
    std::memcpy(v.data(), b.data(), v.size() * 4);
    return v;
}

static uint32_t bits_of(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

// ---------------------------------------------------------------------------------------------------------------
// the "kernels" under test
// ---------------------------------------------------------------------------------------------------------------

static bool g_ties_away = false;  // the seeded bug

// Exact floor(log2(a)) for finite a > 0, from the bits (subnormals included); never a float log2.
static int floor_log2(float a) {
    uint32_t u = bits_of(a) & 0x7fffffffu;
    int e = static_cast<int>(u >> 23);
    if (e > 0) return e - 127;
    int hi = 31;
    while (!(u >> hi)) --hi;  // a subnormal: its leading mantissa bit
    return hi - 149;
}

// fp4 e2m1: the 8 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0..7); sign in bit 3.
struct Fp4 {
    uint8_t code;
    float value;
};

static Fp4 fp4_round(float x) {
    if (std::isnan(x)) return Fp4{0, x};  // fp4 has no NaN: the callers keep NaN away (see mxfp4's NaN blocks)
    double a = std::fabs(static_cast<double>(x));
    // Grid step: 0.5 below 2 (subnormals included), 1 in [2, 4), 2 from 4 up. a / step is exact in double.
    int k = a >= 4.0 ? 1 : (a >= 2.0 ? 0 : -1);
    double q = std::ldexp(a, -k);
    double r = g_ties_away ? std::round(q) : std::nearbyint(q);  // nearbyint: ties to even (default FE mode)
    double v = std::ldexp(r, k);
    if (v > 6.0) v = 6.0;  // saturate (also +-Inf)
    static const double grid[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
    uint8_t mag = 0;
    while (grid[mag] != v) ++mag;
    bool neg = std::signbit(x);
    return Fp4{static_cast<uint8_t>(mag | (neg ? 8 : 0)), static_cast<float>(neg ? -v : v)};
}

// Shared E8M0 exponent of an MXFP4 block from its absmax (finite), for one scale rule.
static int mx_scale_exponent(float amax, const std::string& mode) {
    const int emax_elem = 2;  // fp4: largest value 6 = 1.5 * 2**2
    if (amax == 0.0f) return -127;
    int e = floor_log2(amax);
    int s;
    if (mode == "scale_floor") {
        s = e - emax_elem;
    } else if (mode == "scale_ceil") {
        bool pow2 = static_cast<double>(amax) == std::ldexp(1.0, e);
        s = e - emax_elem + (pow2 ? 0 : 1);
    } else if (mode == "scale_even") {
        // Round amax to the element's 1 mantissa bit (half-even); a carry into the next binade bumps s.
        double r = std::nearbyint(std::ldexp(static_cast<double>(amax), 1 - e));  // in [2, 4]
        s = e - emax_elem + (r >= 4.0 ? 1 : 0);
    } else if (mode == "scale_rceil") {
        // NVIDIA's recipe: the quotient amax / 6 rounded to float32, then its exact power-of-two ceiling.
        float q = amax / 6.0f;
        if (q == 0.0f) return -127;
        int eq = floor_log2(q);
        s = eq + (static_cast<double>(q) == std::ldexp(1.0, eq) ? 0 : 1);
    } else {
        throw std::runtime_error("unknown mode " + mode);
    }
    return s < -127 ? -127 : (s > 127 ? 127 : s);
}

using Outputs = std::map<std::string, std::vector<uint8_t>>;  // role -> bytes

template <class T>
static void put(std::vector<uint8_t>& out, T v) {
    uint8_t b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    out.insert(out.end(), b, b + sizeof(T));
}

// Pack fp4 codes of each row (rows x cols) two per byte: element 2i low nibble, 2i+1 high nibble (odd: pad 0).
static std::vector<uint8_t> pack_rows(const std::vector<uint8_t>& codes, long rows, long cols) {
    std::vector<uint8_t> out;
    for (long r = 0; r < rows; ++r)
        for (long c = 0; c < cols; c += 2) {
            uint8_t lo = codes[r * cols + c], hi = c + 1 < cols ? codes[r * cols + c + 1] : 0;
            out.push_back(static_cast<uint8_t>(lo | (hi << 4)));
        }
    return out;
}

static Outputs fp4_cast_kernel(const std::vector<float>& x) {
    Outputs o;
    std::vector<uint8_t> codes;
    for (float v : x) {
        Fp4 q = fp4_round(v);
        put(o["expected_cast"], q.value);
        codes.push_back(q.code);
    }
    o["expected_codes"] = codes;
    o["expected_packed"] = pack_rows(codes, 1, static_cast<long>(codes.size()));
    return o;
}

static Outputs mxfp4_quantize_kernel(const std::vector<float>& x, long rows, long cols, int block,
                                     const std::string& mode) {
    Outputs o;
    const float qnan = std::numeric_limits<float>::quiet_NaN();
    std::vector<uint8_t> codes(x.size());
    std::vector<float> deq(x.size());
    for (long r = 0; r < rows; ++r) {
        for (long c0 = 0; c0 < cols; c0 += block) {
            long c1 = c0 + block < cols ? c0 + block : cols;  // a ragged last block is shorter
            float amax = 0.0f;
            bool bad = false;
            for (long c = c0; c < c1; ++c) {
                float v = x[r * cols + c];
                if (!std::isfinite(v)) bad = true;
                else amax = std::fmax(amax, std::fabs(v));
            }
            if (bad) {  // NaN or Inf: NaN scale (E8M0 0xFF), codes 0, values NaN
                put(o["expected_scales"], qnan);
                o["expected_scale_codes"].push_back(0xFF);
                for (long c = c0; c < c1; ++c) {
                    codes[r * cols + c] = 0;
                    deq[r * cols + c] = qnan;
                }
                continue;
            }
            int s = mx_scale_exponent(amax, mode);
            float scale = std::ldexp(1.0f, s), inv = std::ldexp(1.0f, -s);  // exact powers of two in float
            put(o["expected_scales"], scale);
            o["expected_scale_codes"].push_back(static_cast<uint8_t>(s + 127));
            for (long c = c0; c < c1; ++c) {
                Fp4 q = fp4_round(x[r * cols + c] * inv);  // float multiply, as the kernel would
                codes[r * cols + c] = q.code;
                deq[r * cols + c] = q.value * scale;
            }
        }
    }
    o["expected_codes"] = codes;
    o["expected_packed"] = pack_rows(codes, rows, cols);
    for (float v : deq) put(o["expected_dequantized"], v);
    return o;
}

// ---------------------------------------------------------------------------------------------------------------
// driver: run the kernels on every fp4 / mxfp4 case, write outputs, compare with the expected .bin files
// ---------------------------------------------------------------------------------------------------------------

static std::string hex(const uint8_t* p, size_t n) {
    char buf[16];
    std::string s = "0x";
    for (size_t i = n; i-- > 0;) {  // little-endian bytes -> big-endian hex
        std::snprintf(buf, sizeof buf, "%02x", p[i]);
        s += buf;
    }
    return s;
}

int main(int argc, char** argv) {
    std::vector<std::string> args;
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        if (a == "--ties-away") g_ties_away = true;
        else args.push_back(a);
    }
    if (args.size() != 2) {
        std::fprintf(stderr, "usage: %s [--ties-away] VECTORS_DIR OUTPUT_DIR\n", argv[0]);
        return 2;
    }
    const fs::path vectors = args[0], outdir = args[1];
    try {
        std::vector<Entry> manifest = read_manifest(vectors);
        std::map<std::string, std::vector<const Entry*>> cases;  // in file order
        std::vector<std::string> order;
        for (const Entry& e : manifest) {
            if (!cases.count(e.kase)) order.push_back(e.kase);
            cases[e.kase].push_back(&e);
        }
        int n_cases = 0, n_bad_cases = 0;
        long n_bad_total = 0;
        for (const std::string& name : order) {
            const std::vector<const Entry*>& files = cases[name];
            const Entry& in = *files[0];
            if (in.role != "input") throw std::runtime_error(name + ": the first file is not the input");
            bool fp4_cast = in.format == "float4_e2m1fn" && in.op == "cast" && in.mode.rfind("nearest_even", 0) == 0;
            bool mxfp4 = in.format == "mxfp4" && in.op == "quantize";
            if (!fp4_cast && !mxfp4) continue;  // not a kernel this program implements
            std::vector<float> x = as_floats(read_bytes(vectors / in.file));
            if (static_cast<long>(x.size()) != in.count()) throw std::runtime_error(name + ": input size");
            long cols = in.dims.empty() ? 1 : in.dims.back();
            long rows = in.count() / (cols ? cols : 1);
            Outputs got = fp4_cast ? fp4_cast_kernel(x) : mxfp4_quantize_kernel(x, rows, cols, in.block_size, in.mode);
            ++n_cases;
            long case_bad = 0;
            for (const Entry* f : files) {
                if (f->role == "input") continue;
                auto it = got.find(f->role);
                if (it == got.end()) {
                    std::printf("  %-40s %-22s not produced by this kernel\n", name.c_str(), f->role.c_str());
                    ++case_bad;
                    continue;
                }
                const std::vector<uint8_t>& mine = it->second;
                write_bytes(outdir / name / (f->role + ".bin"), mine.data(), mine.size());
                std::vector<uint8_t> want = read_bytes(vectors / f->file);
                size_t w = itemsize(f->dtype);
                if (mine.size() != want.size()) {
                    std::printf("  %-40s %-22s size %zu bytes, expected %zu\n", name.c_str(), f->role.c_str(),
                                mine.size(), want.size());
                    ++case_bad;
                    continue;
                }
                long bad = 0;
                for (size_t i = 0; i < want.size(); i += w) {
                    if (std::memcmp(&mine[i], &want[i], w) == 0) continue;
                    if (bad < 3) {
                        long idx = static_cast<long>(i / w);
                        std::string xin = "";
                        if (f->count() == in.count()) {
                            char buf[64];
                            std::snprintf(buf, sizeof buf, " input %.9g (0x%08x)", x[idx], bits_of(x[idx]));
                            xin = buf;
                        }
                        std::printf("  %-40s %-22s [%ld]%s expected %s got %s\n", name.c_str(), f->role.c_str(), idx,
                                    xin.c_str(), hex(&want[i], w).c_str(), hex(&mine[i], w).c_str());
                    }
                    ++bad;
                }
                if (bad) std::printf("  %-40s %-22s %ld of %ld differ\n", name.c_str(), f->role.c_str(), bad, f->count());
                case_bad += bad;
            }
            std::printf("%-8s %s\n", case_bad ? "MISMATCH" : "ok", name.c_str());
            n_bad_total += case_bad;
            n_bad_cases += case_bad ? 1 : 0;
        }
        if (n_cases == 0) {
            std::fprintf(stderr, "no float4_e2m1fn cast or mxfp4 quantize case in %s\n", vectors.string().c_str());
            return 2;
        }
        std::printf("%d case(s), %d with mismatches (%ld values); outputs in %s\n", n_cases, n_bad_cases, n_bad_total,
                    outdir.string().c_str());
        return n_bad_cases ? 1 : 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 2;
    }
}
