// The fused kernels whole on the host (the two-shot, one_shot_q and the 16-bit one-shots): P
// ranks, each a process making its calls one after another, each call's blocks a process each with
// its ECHO_BLOCK threads at once (run_block_at_once), the ranks' regions, peer tables and buffers in
// memory that every process shares (MAP_SHARED, mapped before the first fork). What the phase checks
// (loops_check.cpp) leave out: the work items and their order, flags and epochs, each peer's slots,
// the ticket and epoch at a call's end, several blocks and calls, ranks out of step (the last rank
// starts each call late, with LAST_BLOCKS blocks where the others have BLOCKS), and a peer that
// never comes (LAST_BLOCKS 0: the last rank makes no call, and the others' waits give up after
// kAbsentTimeoutNs). ECHO_HOST_LATE_THREAD=T: thread T of every block lingers after each barrier.
//
//   fused_check DIR KERNEL P COUNT S TILES MAX_TILES BLOCKS LAST_BLOCKS CALLS OFFSET REGION_BYTES RES_IN RES_OUT
//
// DIR/kernels.h (written by tests/test_cuda_host.py from echonccl/kernel_table.py): the kernels'
// ECHO_*_KERNEL lines, and kKernels: a name, a function that runs that kernel's block with a Call's
// arguments (below), and whether the kernel takes tickets (not the low-latency one-shot); KERNEL
// one of its names; kLlBlocks, the low-latency one-shot's most blocks (peer_memory.LL_BLOCKS). TILES: a slice's tiles (the tiled one-shot: threads a tile; the low-latency
// one: lines a slot); MAX_TILES: the flags a slot of the region holds. DIR/table_R.bin: rank R's
// PeerTable (echonccl/peer_memory.py's peer_table) with addresses as offsets into the shared
// memory, rank R's region at R * REGION_BYTES. DIR/x_R_C.bin: rank R's COUNT 16-bit inputs to call
// C (the kernel's type), put OFFSET elements past a 256-byte boundary, as is its output.
// DIR/res0_in_R.bin and DIR/res0_out_R.bin: rank R's residuals before the first call, RES_IN and
// RES_OUT bytes (0: none; the kernel's residual format). Writes DIR/out_R_C.bin, DIR/res_in_R.bin
// and DIR/res_out_R.bin (the residuals after the last call); prints "ok", or what failed (exit
// status 1). Built and run by tests/test_cuda_host.py.
#include "warp_host.h"

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "fused.cuh"

// A buffer, passed to a kernel as whatever pointer type it takes (its data and residual types).
struct Ptr {
    void* p;
    template <class T>
    operator T*() const { return static_cast<T*>(p); }
};

// One rank's call of a fused kernel: what kernels.h's functions pass on, each in its kernel's order.
struct Call {
    Ptr x;
    echo::i64 count;
    Ptr out;
    Ptr res_in, res_out;
    echo::i64 S, rank, P, tiles, max_tiles;
    const echo::PeerTable* table;
    unsigned int* block_epochs;   // the low-latency one-shot's, a rank's
    echo::Ctl* ctl;
    echo::i64 timeout_ns;
};

#include "kernels.h"

using echo::i64;

constexpr int kTableWords = 7 * echo::kMaxRanks + 1;   // peer_memory.peer_table's words
constexpr i64 kTimeoutNs = 60'000'000'000;   // a correct run takes seconds (P = 3: 1280 threads on 2 cores)
constexpr i64 kAbsentTimeoutNs = 300'000'000;

static std::string g_dir;
static std::string path(const std::string& name) { return g_dir + "/" + name; }
static void read_file(const std::string& name, void* p, size_t n) {
    FILE* f = std::fopen(path(name).c_str(), "rb");
    if (!f || std::fread(p, 1, n, f) != n) { std::fprintf(stderr, "cannot read %s\n", name.c_str()); std::exit(2); }
    std::fclose(f);
}
static void write_file(const std::string& name, const void* p, size_t n) {
    FILE* f = std::fopen(path(name).c_str(), "wb");
    if (!f || std::fwrite(p, 1, n, f) != n) { std::fprintf(stderr, "cannot write %s\n", name.c_str()); std::exit(2); }
    std::fclose(f);
}
// Waits for every child in pids; true if each exited with status 0.
static bool wait_all(const std::vector<pid_t>& pids) {
    bool ok = true;
    for (pid_t p : pids) {
        int st = 0;
        ok = waitpid(p, &st, 0) == p && WIFEXITED(st) && WEXITSTATUS(st) == 0 && ok;
    }
    return ok;
}

int main(int argc, char** argv) {
    if (argc != 15) {
        std::fprintf(stderr, "usage: fused_check DIR KERNEL P COUNT S TILES MAX_TILES BLOCKS LAST_BLOCKS CALLS OFFSET "
                             "REGION_BYTES RES_IN RES_OUT\n");
        return 2;
    }
    g_dir = argv[1];
    const std::string kernel = argv[2];
    const int P = std::atoi(argv[3]), blocks = std::atoi(argv[8]), last_blocks = std::atoi(argv[9]),
              calls = std::atoi(argv[10]);
    const i64 count = std::atoll(argv[4]), S = std::atoll(argv[5]), tiles = std::atoll(argv[6]),
              max_tiles = std::atoll(argv[7]), offset = std::atoll(argv[11]), region_bytes = std::atoll(argv[12]),
              res_in_bytes = std::atoll(argv[13]), res_out_bytes = std::atoll(argv[14]);
    if (const char* late = std::getenv("ECHO_HOST_LATE_THREAD")) g_late_thread = std::atoi(late);
    RunFn fn = nullptr;
    bool ticketed = true;   // false: the low-latency one-shot (its blocks' own epochs, no ticket)
    for (const auto& k : kKernels)
        if (kernel == k.name) fn = k.fn, ticketed = k.ticketed;
    if (!fn || P < 2 || P > echo::kMaxRanks) return 2;

    // Shared memory: the regions, then each rank's table, residuals, and per call its input and output.
    auto round_up = [](i64 n) { return (n + 255) / 256 * 256; };
    const i64 vec = round_up((count + offset) * 2), res_in = round_up(res_in_bytes), res_out = round_up(res_out_bytes);
    const i64 epochs = round_up(kLlBlocks * 4);
    const i64 per_rank = round_up(kTableWords * 8) + epochs + res_in + res_out + 2 * calls * vec;
    const i64 bytes = P * region_bytes + P * per_rank;
    auto* base = static_cast<unsigned char*>(
        mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
    if (base == MAP_FAILED) return 2;
    struct Rank {
        echo::Ctl* ctl;
        echo::PeerTable* table;
        unsigned int* block_epochs;
        unsigned char *res_in, *res_out;
        std::vector<unsigned char*> x, out;
    };
    std::vector<Rank> ranks(P);
    for (int r = 0; r < P; ++r) {
        Rank& k = ranks[r];
        unsigned char* p = base + P * region_bytes + r * per_rank;
        k.ctl = reinterpret_cast<echo::Ctl*>(base + r * region_bytes);   // a region's first bytes
        auto* words = reinterpret_cast<unsigned long long*>(p);
        read_file("table_" + std::to_string(r) + ".bin", words, kTableWords * 8);
        for (int i = 0; i < kTableWords - 1; ++i)   // the last word is a size (push_half)
            if (words[i]) words[i] += reinterpret_cast<unsigned long long>(base);
        k.table = reinterpret_cast<echo::PeerTable*>(p);
        p += round_up(kTableWords * 8);
        k.block_epochs = reinterpret_cast<unsigned int*>(p), p += epochs;
        k.res_in = p, p += res_in;
        k.res_out = p, p += res_out;
        if (res_in_bytes) read_file("res0_in_" + std::to_string(r) + ".bin", k.res_in, res_in_bytes);
        if (res_out_bytes) read_file("res0_out_" + std::to_string(r) + ".bin", k.res_out, res_out_bytes);
        for (int c = 0; c < calls; ++c) {
            k.x.push_back(p + offset * 2), p += vec;
            k.out.push_back(p + offset * 2), p += vec;
            read_file("x_" + std::to_string(r) + "_" + std::to_string(c) + ".bin", k.x[c], count * 2);
        }
    }

    // Rank r: its calls in order, each a process a block; the last rank starts each call late and
    // runs one block, so that the others wait for it and run a call ahead of it.
    std::vector<pid_t> rank_pids;
    for (int r = 0; r < P; ++r) {
        const pid_t pid = fork();
        if (pid < 0) return 2;
        if (pid > 0) { rank_pids.push_back(pid); continue; }
        const Rank& k = ranks[r];
        for (int c = 0; c < calls; ++c) {
            if (r == P - 1) usleep(200000);
            const int grid = r == P - 1 ? last_blocks : blocks;
            std::vector<pid_t> block_pids;
            for (int b = 0; b < grid; ++b) {
                const pid_t q = fork();
                if (q < 0) _exit(2);
                if (q > 0) { block_pids.push_back(q); continue; }
                blockIdx.x = (unsigned)b;
                gridDim.x = (unsigned)grid;
                run_block_at_once([&] {
                    fn(Call{{k.x[c]}, count, {k.out[c]}, {k.res_in}, {k.res_out}, S, r, P, tiles, max_tiles, k.table,
                            k.block_epochs, k.ctl, last_blocks ? kTimeoutNs : kAbsentTimeoutNs});
                });
                _exit(0);
            }
            if (!wait_all(block_pids)) _exit(1);
        }
        _exit(0);
    }
    const bool ok = wait_all(rank_pids);

    int failed = 0;
    for (int r = 0; r < P; ++r) {
        const Rank& k = ranks[r];
        if (k.ctl->error) std::printf("rank %d: a wait timed out\n", r), ++failed;
        if (ticketed && (k.ctl->ticket || k.ctl->done || k.ctl->epoch != (unsigned)calls))
            std::printf("rank %d: ctl after %d calls: epoch %u ticket %u done %u\n", r, calls, k.ctl->epoch,
                        k.ctl->ticket, k.ctl->done), ++failed;
        for (int b = 0; !ticketed && b < blocks; ++b)
            if (k.block_epochs[b] != (unsigned)calls)
                std::printf("rank %d: block %d's epoch %u after %d calls\n", r, b, k.block_epochs[b], calls), ++failed;
        for (int c = 0; c < calls; ++c)
            write_file("out_" + std::to_string(r) + "_" + std::to_string(c) + ".bin", k.out[c], count * 2);
        write_file("res_in_" + std::to_string(r) + ".bin", k.res_in, res_in_bytes);
        write_file("res_out_" + std::to_string(r) + ".bin", k.res_out, res_out_bytes);
    }
    if (!ok) std::printf("a rank or block process failed\n"), ++failed;
    if (!failed) std::printf("ok\n");
    return failed ? 1 : 0;
}
