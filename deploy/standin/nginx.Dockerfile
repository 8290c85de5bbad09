# Stand-in for nginx:1.28-alpine (deploy/standin/build.sh): Debian 12's nginx, configured like the
# official image (conf.d/*.conf only, logs to the container's output, in the foreground), plus wget
# for compose.yaml's healthcheck.
FROM metrale/debian-base:bookworm
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx wget \
    && rm -rf /var/lib/apt/lists/* /etc/nginx/sites-enabled/* /etc/nginx/conf.d/* \
    && ln -sf /dev/stdout /var/log/nginx/access.log && ln -sf /dev/stderr /var/log/nginx/error.log
EXPOSE 80
STOPSIGNAL SIGQUIT
CMD ["nginx", "-g", "daemon off;"]
