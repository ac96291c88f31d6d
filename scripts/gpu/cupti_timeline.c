/*
 * A CUDA injection library (CUDA_INJECTION64_PATH) that records, without changing the
 * program, every kernel, copy and memset a process runs on the GPU, with its device, stream,
 * start and end (CUPTI's activity API, concurrent-kernel mode: kernels are not serialised),
 * and writes them as text lines to $CUPTI_TIMELINE_DIR/timeline-<pid>.txt:
 *   K <device> <stream> <start ns> <end ns> <name>
 *   C <device> <stream> <start ns> <end ns> <copy kind> <bytes>
 *   S <device> <stream> <start ns> <end ns> memset <bytes>
 * Untraced by the program itself: the timeline of a run as it runs (timeline_report.py reads
 * it). Build: cc -shared -fPIC -DKREC=<CUpti_ActivityKernelN> ... -lcupti (timeline_there.sh).
 */
#include <cupti.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define BUF_BYTES (16u << 20)

static FILE *out;
static pthread_mutex_t out_lock = PTHREAD_MUTEX_INITIALIZER;

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
  *buffer = aligned_alloc(8, BUF_BYTES);
  *size = *buffer ? BUF_BYTES : 0;
  *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer,
                                      size_t size, size_t valid) {
  (void)ctx;
  (void)stream;
  (void)size;
  CUpti_Activity *r = NULL;
  pthread_mutex_lock(&out_lock);
  while (out && cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) {
    switch (r->kind) {
    case CUPTI_ACTIVITY_KIND_KERNEL:
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
      KREC *k = (KREC *)r;
      fprintf(out, "K %u %u %llu %llu %s\n", k->deviceId, k->streamId,
              (unsigned long long)k->start, (unsigned long long)k->end,
              k->name ? k->name : "?");
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
      CREC *c = (CREC *)r;
      fprintf(out, "C %u %u %llu %llu %u %llu\n", c->deviceId, c->streamId,
              (unsigned long long)c->start, (unsigned long long)c->end,
              (unsigned)c->copyKind, (unsigned long long)c->bytes);
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
      SREC *s = (SREC *)r;
      fprintf(out, "S %u %u %llu %llu memset %llu\n", s->deviceId, s->streamId,
              (unsigned long long)s->start, (unsigned long long)s->end,
              (unsigned long long)s->bytes);
      break;
    }
    default:
      break;
    }
  }
  size_t dropped = 0;
  if (cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped) == CUPTI_SUCCESS && dropped && out)
    fprintf(out, "D %zu dropped\n", dropped);
  if (out)
    fflush(out);
  pthread_mutex_unlock(&out_lock);
  free(buffer);
}

static void flush_at_exit(void) {
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  pthread_mutex_lock(&out_lock);
  if (out) {
    fclose(out);
    out = NULL;
  }
  pthread_mutex_unlock(&out_lock);
}

int InitializeInjection(void) {
  const char *dir = getenv("CUPTI_TIMELINE_DIR");
  char path[4096];
  snprintf(path, sizeof path, "%s/timeline-%d.txt", dir ? dir : "/tmp", (int)getpid());
  out = fopen(path, "w");
  if (!out)
    return 0;
  if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET) != CUPTI_SUCCESS) {
    fprintf(out, "E cupti setup failed\n");
    fclose(out);
    out = NULL;
    return 0;
  }
  cuptiActivityFlushPeriod(200);
  atexit(flush_at_exit);
  return 1;
}
