/* tests/support/ports.c - a free TCP port for a test (ports.h). */
#include "tests/support/ports.h"

#include <criterion/criterion.h>

#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

uint16_t tu_free_port(void)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t len = sizeof(a);
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

	cr_assert(fd >= 0 && !bind(fd, (struct sockaddr *)&a, sizeof(a)) &&
		  !getsockname(fd, (struct sockaddr *)&a, &len), "no free port: %s", strerror(errno));
	close(fd);
	return ntohs(a.sin_port);
}
