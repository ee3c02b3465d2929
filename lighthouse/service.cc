#include "lighthouse/service.h"

#include "lighthouse/service_impl.h"

namespace lk::lighthouse {


Service::Service(asio::io_context& ioc, ServiceOptions options, std::unique_ptr<StateStore> store)
    : impl_(std::make_shared<Impl>(ioc, [&] {
        // The service reads answers' members from the shared list, so the core need not copy
        // the member list into every answer (n copies of n members at 1,024 groups).
        options.core.answer_members_inline = false;
        return std::move(options);
      }(), std::move(store))) {}

Service::~Service() = default;

Status Service::Start() { return impl_->Start(); }

std::string Service::address() const {
  return impl_->server ? impl_->server->LocalAddress() : "";
}

http::Handler Service::handler() const {
  return [impl = impl_](http::Request&& req, http::Responder respond) {
    impl->Route(std::move(req), std::move(respond));
  };
}

void Service::Shutdown() { impl_->Shutdown(); }

}  // namespace lk::lighthouse
