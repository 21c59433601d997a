package webhook

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"
)

// Serve serves h over TLS on l with the keeper's certificate until ctx ends,
// then shuts down gracefully (in-flight reviews finish, within 10 s).
// Every phase of a connection is bounded: a client that sends slowly or
// never reads is dropped.
func Serve(ctx context.Context, l net.Listener, h http.Handler, getCert func(*tls.ClientHelloInfo) (*tls.Certificate, error)) error {
	mux := http.NewServeMux()
	mux.Handle(Path, h)
	srv := &http.Server{
		Handler:           mux,
		TLSConfig:         &tls.Config{MinVersion: tls.VersionTLS12, GetCertificate: getCert},
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       30 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       90 * time.Second,
		MaxHeaderBytes:    64 << 10,
	}
	done := make(chan error, 1)
	go func() { done <- srv.ServeTLS(l, "", "") }()
	select {
	case err := <-done:
		return fmt.Errorf("webhook server: %w", err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := srv.Shutdown(sctx)
	if serr := <-done; !errors.Is(serr, http.ErrServerClosed) && err == nil {
		err = serr
	}
	return err
}
