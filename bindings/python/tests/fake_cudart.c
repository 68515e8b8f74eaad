/* A stand-in for libcudart's host-function API, for testing the CUDA-stream path without a
 * GPU: cudaLaunchHostFunc queues the callback, one thread runs callbacks in order (as a stream
 * does), cudaStreamSynchronize waits until all have run. All streams share the one queue. */
#include <pthread.h>
#include <stdlib.h>

typedef void (*host_fn)(void *);
struct item { host_fn fn; void *data; struct item *next; };

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static struct item *head, *tail;
static long pending, ran;
static int started;

static void *worker(void *arg) {
    (void)arg;
    for (;;) {
        pthread_mutex_lock(&mu);
        while (!head) pthread_cond_wait(&cv, &mu);
        struct item *it = head;
        head = it->next;
        if (!head) tail = NULL;
        pthread_mutex_unlock(&mu);
        it->fn(it->data);
        free(it);
        pthread_mutex_lock(&mu);
        pending--;
        ran++;
        pthread_cond_broadcast(&cv);
        pthread_mutex_unlock(&mu);
    }
    return NULL;
}

int cudaLaunchHostFunc(void *stream, host_fn fn, void *data) {
    if (!stream || !fn) return 1; /* cudaErrorInvalidValue */
    struct item *it = malloc(sizeof *it);
    if (!it) return 2;
    it->fn = fn;
    it->data = data;
    it->next = NULL;
    pthread_mutex_lock(&mu);
    if (!started) {
        pthread_t t;
        pthread_create(&t, NULL, worker, NULL);
        pthread_detach(t);
        started = 1;
    }
    if (tail) tail->next = it; else head = it;
    tail = it;
    pending++;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
    return 0;
}

int cudaStreamSynchronize(void *stream) {
    (void)stream;
    pthread_mutex_lock(&mu);
    while (pending) pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
    return 0;
}

long fake_host_calls(void) {
    pthread_mutex_lock(&mu);
    long n = ran;
    pthread_mutex_unlock(&mu);
    return n;
}
