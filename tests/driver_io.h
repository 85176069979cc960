/* Input of the stand-alone kernel drivers (rows_driver.c, codes_driver.c): read from stdin. */
#ifndef DGPIPE_DRIVER_IO_H
#define DGPIPE_DRIVER_IO_H
#include <stdio.h>
#include <stdlib.h>

/* count items of size bytes from stdin into a new buffer; NULL on short input or out of memory. */
static void *read_n(size_t size, size_t count) {
    void *p = malloc(size * count + 1);
    if (p && fread(p, size, count, stdin) != count) {
        free(p);
        return NULL;
    }
    return p;
}

#endif
