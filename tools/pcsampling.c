/* CUPTI PC sampling with stall reasons, for tools/stall_profile.py (the GPU image has no
 * profiler). A thin C layer over cupti_pcsampling.h: enable on a context, start / stop a
 * range, then drain the range's samples into flat arrays (function, PC offset, samples per
 * stall reason) that the Python side reads with ctypes.
 *
 *   gcc -shared -fPIC -O2 -I$CUDA/include -I$CUPTI/include tools/pcsampling.c -o pcsampling.so
 *
 * libcupti.so.13 must be loaded (RTLD_GLOBAL) before this library. Every function returns a
 * CUptiResult (0 = success); pcs_error() names the last failure.
 */
#include <cuda.h>
#include <cupti_pcsampling.h>
#include <cupti_result.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

CUptiResult CUPTIAPI cuptiGetResultString(CUptiResult result, const char **str);

#define MAX_FUNCS 512
#define BUF_PCS 4096

static CUcontext g_ctx;
static size_t g_nreasons;
static uint32_t *g_index;       /* stall reason index, by position */
static char **g_names;          /* stall reason name, by position */
static CUpti_PCSamplingData g_conf_buf, g_get_buf;
static char *g_funcs[MAX_FUNCS];
static int g_nfuncs;
static char g_err[256];

const char *pcs_error(void) { return g_err; }

static CUptiResult check(CUptiResult r, const char *what) {
    if (r != CUPTI_SUCCESS) {
        const char *s = "?";
        cuptiGetResultString(r, &s);
        snprintf(g_err, sizeof g_err, "%s: %s (%d)", what, s, (int)r);
    }
    return r;
}

static int alloc_buf(CUpti_PCSamplingData *b) {
    memset(b, 0, sizeof *b);
    b->size = sizeof *b;
    b->collectNumPcs = BUF_PCS;
    b->pPcData = (CUpti_PCSamplingPCData *)calloc(BUF_PCS, sizeof(CUpti_PCSamplingPCData));
    if (!b->pPcData) return 0;
    for (size_t i = 0; i < BUF_PCS; ++i) {
        b->pPcData[i].size = sizeof(CUpti_PCSamplingPCData);
        b->pPcData[i].stallReason = (CUpti_PCSamplingStallReason *)calloc(g_nreasons, sizeof(CUpti_PCSamplingStallReason));
        if (!b->pPcData[i].stallReason) return 0;
    }
    return 1;
}

/* Enable PC sampling on ctx (a CUcontext), sampling every 2^period cycles per SM, in
 * continuous mode with start/stop ranges. Call before loading the modules to profile. */
int pcs_enable(void *ctx, unsigned period) {
    g_ctx = (CUcontext)ctx;
    CUpti_PCSamplingEnableParams ep = {CUpti_PCSamplingEnableParamsSize, NULL, g_ctx};
    CUptiResult r = check(cuptiPCSamplingEnable(&ep), "cuptiPCSamplingEnable");
    if (r) return r;
    CUpti_PCSamplingGetNumStallReasonsParams np = {CUpti_PCSamplingGetNumStallReasonsParamsSize, NULL, g_ctx, &g_nreasons};
    if ((r = check(cuptiPCSamplingGetNumStallReasons(&np), "cuptiPCSamplingGetNumStallReasons"))) return r;
    g_index = (uint32_t *)calloc(g_nreasons, sizeof *g_index);
    g_names = (char **)calloc(g_nreasons, sizeof *g_names);
    for (size_t i = 0; i < g_nreasons; ++i) g_names[i] = (char *)calloc(CUPTI_STALL_REASON_STRING_SIZE, 1);
    CUpti_PCSamplingGetStallReasonsParams sp = {CUpti_PCSamplingGetStallReasonsParamsSize, NULL, g_ctx, g_nreasons,
                                                g_index, g_names};
    if ((r = check(cuptiPCSamplingGetStallReasons(&sp), "cuptiPCSamplingGetStallReasons"))) return r;
    if (!alloc_buf(&g_conf_buf) || !alloc_buf(&g_get_buf)) {
        snprintf(g_err, sizeof g_err, "out of host memory");
        return CUPTI_ERROR_OUT_OF_MEMORY;
    }
    CUpti_PCSamplingConfigurationInfo c[6];
    memset(c, 0, sizeof c);
    c[0].attributeType = CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_SAMPLING_PERIOD;
    c[0].attributeData.samplingPeriodData.samplingPeriod = period;
    c[1].attributeType = CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_STALL_REASON;
    c[1].attributeData.stallReasonData.stallReasonCount = g_nreasons;
    c[1].attributeData.stallReasonData.pStallReasonIndex = g_index;
    c[2].attributeType = CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_COLLECTION_MODE;
    c[2].attributeData.collectionModeData.collectionMode = CUPTI_PC_SAMPLING_COLLECTION_MODE_CONTINUOUS;
    c[3].attributeType = CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_ENABLE_START_STOP_CONTROL;
    c[3].attributeData.enableStartStopControlData.enableStartStopControl = 1;
    c[4].attributeType = CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_SAMPLING_DATA_BUFFER;
    c[4].attributeData.samplingDataBufferData.samplingDataBuffer = &g_conf_buf;
    c[5].attributeType = CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_SCRATCH_BUFFER_SIZE;
    c[5].attributeData.scratchBufferSizeData.scratchBufferSize = (size_t)64 << 20;
    CUpti_PCSamplingConfigurationInfoParams cp = {CUpti_PCSamplingConfigurationInfoParamsSize, NULL, g_ctx, 6, c};
    return check(cuptiPCSamplingSetConfigurationAttribute(&cp), "cuptiPCSamplingSetConfigurationAttribute");
}

size_t pcs_num_reasons(void) { return g_nreasons; }
const char *pcs_reason(size_t i) { return g_names[i]; }

int pcs_start(void) {
    CUpti_PCSamplingStartParams p = {CUpti_PCSamplingStartParamsSize, NULL, g_ctx};
    return check(cuptiPCSamplingStart(&p), "cuptiPCSamplingStart");
}

int pcs_stop(void) {
    CUpti_PCSamplingStopParams p = {CUpti_PCSamplingStopParamsSize, NULL, g_ctx};
    return check(cuptiPCSamplingStop(&p), "cuptiPCSamplingStop");
}

static int func_id(const char *name) {
    for (int i = 0; i < g_nfuncs; ++i)
        if (strcmp(g_funcs[i], name) == 0) return i;
    if (g_nfuncs == MAX_FUNCS) return MAX_FUNCS - 1;
    g_funcs[g_nfuncs] = strdup(name ? name : "?");
    return g_nfuncs++;
}

const char *pcs_func_name(int i) { return i >= 0 && i < g_nfuncs ? g_funcs[i] : ""; }

/* Move buffer b's PCs into the output arrays (merging equal (function, offset) rows).
 * counts: [maxpc][nreasons] by reason position. totals: [total, dropped, non-user, hw full]. */
static long drain(CUpti_PCSamplingData *b, int *func, uint64_t *off, uint32_t *counts, long n, long maxpc,
                  uint64_t *totals) {
    totals[0] += b->totalSamples;
    totals[1] += b->droppedSamples;
    totals[2] += b->nonUsrKernelsTotalSamples;
    totals[3] |= b->hardwareBufferFull;
    for (size_t i = 0; i < b->totalNumPcs; ++i) {
        const CUpti_PCSamplingPCData *d = &b->pPcData[i];
        const int f = func_id(d->functionName);
        long row = -1;
        for (long k = 0; k < n; ++k)
            if (func[k] == f && off[k] == d->pcOffset) { row = k; break; }
        if (row < 0) {
            if (n == maxpc) continue;
            row = n++;
            func[row] = f;
            off[row] = d->pcOffset;
            memset(counts + row * g_nreasons, 0, g_nreasons * sizeof *counts);
        }
        for (size_t s = 0; s < d->stallReasonCount; ++s)
            for (size_t p = 0; p < g_nreasons; ++p)
                if (g_index[p] == d->stallReason[s].pcSamplingStallReasonIndex) {
                    counts[row * g_nreasons + p] += d->stallReason[s].samples;
                    break;
                }
    }
    b->totalNumPcs = 0;
    b->totalSamples = b->droppedSamples = b->nonUsrKernelsTotalSamples = 0;
    b->hardwareBufferFull = 0;
    return n;
}

/* After pcs_stop (and a device synchronization): every PC sampled in the range. Returns the
 * number of rows (>= 0) or -(CUptiResult). */
long pcs_collect(int *func, uint64_t *off, uint32_t *counts, long maxpc, uint64_t *totals) {
    long n = drain(&g_conf_buf, func, off, counts, 0, maxpc, totals);
    for (int guard = 0; guard < 100000; ++guard) {
        CUpti_PCSamplingGetDataParams p = {CUpti_PCSamplingGetDataParamsSize, NULL, g_ctx, &g_get_buf};
        CUptiResult r = check(cuptiPCSamplingGetData(&p), "cuptiPCSamplingGetData");
        if (r) return -(long)r;
        const size_t remaining = g_get_buf.remainingNumPcs, got = g_get_buf.totalNumPcs;
        n = drain(&g_get_buf, func, off, counts, n, maxpc, totals);
        if (remaining == 0 && got == 0) break;
    }
    return n;
}
