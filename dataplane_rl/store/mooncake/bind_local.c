/* LD_PRELOAD shim for the Mooncake holders of a one-machine store (built by store/mooncake/bind_shim.py).
 *
 * Mooncake's transfer engine binds its handshake and TCP data listeners to the wildcard address
 * (INADDR_ANY, and [::] dual-stack for the data port) and offers no switch for it, so a store that
 * advertises 127.0.0.1 still listens on every interface. With DATAPLANE_RL_BIND_ADDRESS=<IPv4> set, this
 * bind() replaces a wildcard address by that address (an IPv6 wildcard by its v4-mapped form, which a
 * dual-stack socket accepts) and leaves every other bind alone.
 *
 * A process that did not preload it (a library user's Python) loads it with dlopen, points the `bind`
 * slots of Mooncake's libraries at this bind() (store/mooncake/bind_patch.py) and names the address with
 * dataplane_rl_bind_to(); DATAPLANE_RL_BIND_ADDRESS, where set, still wins. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static char bind_to_ip[INET_ADDRSTRLEN];  /* set before the engine starts; empty: only the variable counts */

void dataplane_rl_bind_to(const char *ip) {
    strncpy(bind_to_ip, ip ? ip : "", sizeof bind_to_ip - 1);
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind;
    if (!real_bind) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    const char *ip = getenv("DATAPLANE_RL_BIND_ADDRESS");
    if (!ip && bind_to_ip[0]) ip = bind_to_ip;
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
