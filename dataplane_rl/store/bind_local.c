/* LD_PRELOAD shim for the Mooncake holders of a one-machine store (see mooncake_cluster.bind_shim).
 *
 * Mooncake's transfer engine binds its handshake and TCP data listeners to the wildcard address
 * (INADDR_ANY, and [::] dual-stack for the data port) and offers no switch for it, so a store that
 * advertises 127.0.0.1 still listens on every interface. With DATAPLANE_RL_BIND_ADDRESS=<IPv4> set, this
 * bind() replaces a wildcard address by that address (an IPv6 wildcard by its v4-mapped form, which a
 * dual-stack socket accepts) and leaves every other bind alone. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind;
    if (!real_bind) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    const char *ip = getenv("DATAPLANE_RL_BIND_ADDRESS");
    struct in_addr v4;
    if (!ip || !addr || inet_pton(AF_INET, ip, &v4) != 1) return real_bind(fd, addr, len);
    if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
            a.sin_addr = v4;
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    } else if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr)) {
            memset(&a.sin6_addr, 0, sizeof a.sin6_addr);
            a.sin6_addr.s6_addr[10] = 0xff;
            a.sin6_addr.s6_addr[11] = 0xff;
            memcpy(&a.sin6_addr.s6_addr[12], &v4, 4);
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    }
    return real_bind(fd, addr, len);
}
