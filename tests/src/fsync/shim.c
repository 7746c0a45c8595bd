/* An fsync error for the fault campaign (tests/src/fsync.rs): preloaded into a router
 * (LD_PRELOAD), it makes fsync(2) and fdatasync(2) fail with EIO, the error a disk that
 * loses writes reports, for every file whose path starts with NARWHAL_TEST_FSYNC_UNDER while
 * the file named by NARWHAL_TEST_FSYNC_FAIL exists. Everything else goes to libc. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int failing(int fd) {
    const char *flag = getenv("NARWHAL_TEST_FSYNC_FAIL");
    const char *under = getenv("NARWHAL_TEST_FSYNC_UNDER");
    struct stat st;
    char link[64], path[PATH_MAX];
    ssize_t n;
    if (flag == NULL || under == NULL || *under == '\0' || stat(flag, &st) != 0)
        return 0;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    n = readlink(link, path, sizeof path - 1);
    if (n < 0)
        return 0;
    path[n] = '\0';
    return strncmp(path, under, strlen(under)) == 0;
}

/* EIO while the fault holds for `fd`, else libc's `name` (looked up once into `*real`). */
static int sync_call(int fd, const char *name, int (**real)(int)) {
    if (failing(fd)) {
        errno = EIO;
        return -1;
    }
    if (*real == NULL)
        *real = (int (*)(int))dlsym(RTLD_NEXT, name);
    return (*real)(fd);
}

int fsync(int fd) {
    static int (*real)(int);
    return sync_call(fd, "fsync", &real);
}

int fdatasync(int fd) {
    static int (*real)(int);
    return sync_call(fd, "fdatasync", &real);
}
